"""The end of a step and of the run: the checkpoint, the stop after a preemption signal, the final
weights.

``end_step`` writes a checkpoint atomically every ``checkpoint.every_steps`` steps and after the
last one (never after a step with a non-finite optimizer step: its weights may not be good); after a
SIGTERM / SIGUSR1 on any rank (or on a rollout rank, as its last batch said), every rank stops
there, with that step's checkpoint (grpo_ds/run/preemption.py). ``end_run`` records the final
weights' hash on every rank (and the rollout copy's, which must equal it), saves the final model
when asked, and marks the run folder complete.
"""

from __future__ import annotations

from pathlib import Path

from grpo_ds.model.policy import Policy, weights_sha256
from grpo_ds.run import checkpoint, writes
from grpo_ds.run import folder as run_folder
from grpo_ds.run.preemption import Preempted, StopRequest
from grpo_ds.step.context import StepContext
from grpo_ds.step.profiling import Phase
from grpo_ds.step.report import append_json


def end_step(
    ctx: StepContext, step: int, policy: Policy, schedule, stop: StopRequest, nonfinite: int
) -> None:
    """The step's checkpoint when due; then, after a stop signal, the checkpoint if none was
    written, and every rank raises Preempted (``schedule`` tells the rollout ranks of a split
    placement first)."""
    recipe, dist, run_dir = ctx.recipe, ctx.dist, ctx.run_dir
    every, saved = recipe.checkpoint.every_steps, None
    trainer_state = {
        **schedule.in_flight(),
        "history": ctx.logger.history,
        "data": ctx.inputs.data_identity,
    }
    if every is not None and (step % every == 0 or step == recipe.train.steps) and not nonfinite:
        with Phase("checkpoint"):
            saved = checkpoint.save(
                policy, run_dir, step, trainer_state, recipe.checkpoint.keep, dist
            )
    # even a signal that came during the checkpoint above stops the run here
    stop_signal = (
        (stop.agreed(dist) or schedule.rollout_stop) if step < recipe.train.steps else None
    )
    if stop_signal:
        if saved is None and not nonfinite:
            with Phase("checkpoint"):
                saved = checkpoint.save(
                    policy, run_dir, step, trainer_state, recipe.checkpoint.keep, dist
                )
        ctx.logger.close()
        stopped = Preempted(stop_signal, step, recipe.train.steps, saved and str(saved))
        schedule.stop(stopped)
        raise stopped
    stop.track(run_dir, None)


def end_run(ctx: StepContext, policy: Policy, rank_log: Path) -> None:
    """After the last step: the final weights' hash in every rank's log, the final model
    (run.save_final_model) and the run folder marked complete."""
    recipe, dist, run_dir, rollout = ctx.recipe, ctx.dist, ctx.run_dir, ctx.rollout
    save = dist.is_main and recipe.run.save_final_model
    digest, state = policy.final_weights(ctx.bucket_bytes, keep=save)
    final = {"final_weights_sha256": digest}
    if rollout is not None and rollout.model is not None and not rollout.shares_policy_weights:
        final["rollout_weights_sha256"] = weights_sha256(rollout.model.named_parameters())
    # a failed write: one error on every rank
    with checkpoint.run_file_writes(dist, run_dir, "end of the run"):
        append_json(rank_log, final)
        if save:
            with (
                writes.writing(run_dir / "final_model"),
                writes.folder_written(run_dir / "final_model") as folder,
            ):
                policy.save_pretrained(folder, state, ctx.inputs.tokenizer)
        if dist.is_main:
            run_folder.mark_complete(run_dir, recipe.train.steps, digest)
