"""Train a policy with GRPO on DeepSpeed ZeRO-3: the CLI and the driver loop, top to bottom.

    python -m grpo_ds.launch --num_gpus 8 --module grpo_ds.train RECIPE.json [section.key=value ...]
    python -m grpo_ds.train RECIPE.json [section.key=value ...]
    grpo_ds.train("RECIPE.json", overrides={"train.steps": 10})   # returns the per-step metrics

One step: rollout -> reward -> plan -> old/ref log-probs -> advantage -> loss -> backward -> step
-> weight sync -> log. The advantage comes after the log-prob passes because KL-in-reward shaping
needs the reference log-probs. Rank 0 makes every global decision (prompts, rewards, the micro-batch
plan, advantages); every rank computes its shard. Everything the user can get wrong is checked
before a model loads or a file is written.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed import launcher
from grpo_ds.distributed.messages import BridgeError
from grpo_ds.distributed.ranks import Dist, device_type, end_launched_rank, init_distributed
from grpo_ds.errors import Relayed, UserError, exit_on_user_error
from grpo_ds.model import sequence_parallel
from grpo_ds.run import output_paths
from grpo_ds.run.host_allocator import return_large_frees
from grpo_ds.run.preemption import Preempted, StopRequest, stop_on_signals, stop_word
from grpo_ds.run.preflight import Inputs, prepare_inputs
from grpo_ds.session import Session
from grpo_ds.step import evaluate, report, save
from grpo_ds.step.advantage import add_advantages
from grpo_ds.step.guard import NonfiniteGuard
from grpo_ds.step.loss import LossStats
from grpo_ds.step.plan import plan_recipe_step
from grpo_ds.step.profiling import Phase, profiled_steps
from grpo_ds.step.schedule import serve_rollouts
from grpo_ds.step.update import logprob_pass, optimizer_step


def run(
    recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None = None
) -> list[dict]:
    """Run a recipe to the end; return one metrics dict per step (on every rank). A Ctrl-C (SIGINT)
    stops it after the current step with a checkpoint and reaches the caller as KeyboardInterrupt;
    SIGTERM or SIGUSR1 as Preempted (grpo_ds/run/preemption.py)."""
    return _stoppable_run(recipe, overrides, leave_process=False)


def _stoppable_run(
    recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None, leave_process: bool
) -> list[dict]:
    """``run`` under the stop signals' handlers; ``leave_process``: the command line's (see
    StopRequest)."""
    try:
        with stop_on_signals(leave_process) as stop:
            return _run(recipe, overrides, stop)
    finally:
        # transformers' attention as it was, for whatever this process runs next
        sequence_parallel.restore()


def _run(
    recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None, stop: StopRequest
) -> list[dict]:
    # ---- 1. validate everything before any model loads or any file is written
    inputs = prepare_inputs(recipe, overrides, launcher.world_size(), device_type())
    recipe = inputs.recipe
    # a stop signal's deadline (grpo_ds/run/preemption.py)
    stop.set_grace(recipe.run.preempt_grace_s)

    # ---- 2. processes. Split placement: the last rollout.ranks ranks only generate (_generate)
    dist = init_distributed(
        recipe.train.tensor_parallel_size,
        recipe.train.sequence_parallel_size,
        inputs.placement.rollout_ranks,
        recipe.rollout.transfer_timeout_s,
    )
    # every folder the run writes in, made and written once, then removed
    output_paths.probe_on_rank_0(recipe, dist)
    if dist.role == "rollout":
        return _generate(inputs, dist, stop)
    # ---- 3. the run's parts (grpo_ds/session.py): the lock, the run folder, the logger, the
    # engines, the schedule
    with Session(inputs, dist, stop) as session:
        session.open_trainer()
        return session.finished if session.finished is not None else _train(session)


def _train(session: Session) -> list[dict]:
    """The driver loop: the steps of one trainer rank, from the first to run to the last."""
    ctx, policy, schedule, stop = session.ctx, session.policy, session.schedule, session.stop
    recipe, dist, settings = ctx.recipe, ctx.dist, ctx.settings
    guard = NonfiniteGuard(recipe.train.max_nonfinite_steps, ctx.run_dir)

    for step in profiled_steps(
        range(session.first_step, recipe.train.steps + 1), recipe.logging, ctx.run_dir, dist
    ):
        stop.track(ctx.run_dir, step)
        # ---- rollout and reward (grpo_ds.step.collect): rank 0 picks the prompts, every rank
        # generates a slice, rank 0 scores them; with dynamic sampling, equal-reward groups are
        # replaced by new prompts. Under split placement the rollout ranks did this, and the
        # trainer's rank 0 receives it (grpo_ds.step.schedule)
        data = schedule.batch(step)

        # ---- plan: optimizer steps, per-rank shards, micro-batches (rank 0 decides)
        data.plan = dist.decide(
            plan_recipe_step, recipe, data.sequence_tokens(), dist.dp_size, step, settings.packed
        )

        # ---- old / reference log-probs, each pass with the log-prob phase's own micro size; from
        # here to the end of the update, freed tensors of 1 MiB and more go back to the system
        # (grpo_ds/run/host_allocator.py)
        return_large_frees(True)
        with Phase("logprob", data.times, data.spans):
            if data.plan.old_logprob_pass:
                data.old_logprobs = logprob_pass(policy.engine, data, settings, dist)
            if policy.reference_engine is not None:
                with policy.reference() as reference:
                    data.ref_logprobs = logprob_pass(reference, data, settings, dist)

        # ---- advantage: shaped rewards (overlong penalty, KL in the reward) -> group advantages
        # (rank 0)
        with Phase("advantage"):  # labelled for traces; not timed into time_step_s
            add_advantages(ctx, data)

        # ---- policy update: one optimizer step per mini-batch, each checked by the NaN guard
        stats = LossStats()
        guard.start_step()
        with Phase("update", data.times, data.spans):
            for minibatch in data.plan.minibatches:
                minibatch_stats, stepped = optimizer_step(
                    policy.engine, data, minibatch, settings, dist
                )
                stats += minibatch_stats
                guard.after_optimizer_step(step, stepped, policy.engine)
        return_large_frees(False)

        # ---- weight sync: ZeRO-3 shards -> full weights (LoRA: merged adapted layers), bucket by
        # bucket, into the rank's rollout engine (colocated) or to the rollout ranks that will
        # generate with them (split)
        schedule.weights_changed(step, policy, data.times, data.spans)

        # ---- log (and evaluate when due)
        metrics = report.step_metrics(
            ctx, step, data, stats.summed_over_ranks(dist), guard, policy.engine.get_lr()[0]
        )
        if ctx.inputs.eval_prompts and evaluate.due(step, recipe):
            with Phase("eval") as phase:
                metrics.update(evaluate.evaluate(step, ctx))
            metrics["time_eval_s"] = phase.seconds
        report.write_step(ctx, step, data, schedule.role, session.rank_log)

        # ---- checkpoint when due, and the stop after a preemption signal
        # (grpo_ds/run/preemption.py)
        save.end_step(ctx, step, policy, schedule, stop, guard.nonfinite)

    # ---- the end: the final weights' hash on every rank (and the rollout copy's), the final model;
    # the rollout ranks of a split placement get the history and leave; the session then closes the
    # parts (vLLM last)
    save.end_run(ctx, policy, session.rank_log)
    ctx.logger.close()
    schedule.finish(ctx.logger.history)
    dist.barrier()
    return ctx.logger.history


def _generate(inputs: Inputs, dist: Dist, stop: StopRequest) -> list[dict]:
    """A rollout rank of a split placement, from start to end: its parts (grpo_ds/session.py), then
    the rollout side of the schedule (grpo_ds.step.schedule.serve_rollouts)."""
    try:
        with Session(inputs, dist, stop) as session:
            session.open_rollout()
            if session.finished is not None:  # the trainer's rank 0 said so
                return session.finished
            return serve_rollouts(session.ctx, session.bridge, stop, session.rank_log)
    # e.g. reward.on_error "raise": launcher.say prints on the launch's rank 0 only
    except UserError as err:
        if dist.is_main and not isinstance(err, Relayed):
            launcher.say_on_each_rank(f"error: {err}")
        raise


# ----------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="grpo_ds.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="path to a recipe JSON file")
    parser.add_argument(
        "overrides", nargs="*", help="section.key=value (value parsed as JSON when it parses)"
    )
    # set by `deepspeed`
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    code, stopped = 0, False
    try:
        with exit_on_user_error():
            _stoppable_run(args.recipe, args.overrides, leave_process=True)
    except Preempted as signalled:  # SIGTERM / SIGUSR1: 75; Ctrl-C: 130 (grpo_ds/run/preemption.py)
        launcher.say(f"{stop_word(signalled.signal_name)}: {signalled}")
        code, stopped = signalled.exit_code, True
    # split placement: a stall or a refused message, naming the other side
    except BridgeError as failed:
        launcher.say_on_each_rank(f"error: {failed}")
        code = 1
    except SystemExit as leaving:  # exit_on_user_error's one-line error
        code = 0 if leaving.code is None else leaving.code if isinstance(leaving.code, int) else 1
    # a launched or stopped rank leaves here (see there); else exits as before
    launcher.record_exit(code)
    end_launched_rank(code, stopped)
    if code:
        sys.exit(code)


class _CallableModule(types.ModuleType):
    """Lets `grpo_ds.train(...)` be called although `grpo_ds.train` is also the CLI module."""

    def __call__(
        self, recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None = None
    ) -> list[dict]:
        return run(recipe, overrides)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
