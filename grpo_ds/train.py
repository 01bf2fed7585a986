"""Train a policy with GRPO on DeepSpeed ZeRO-3: the CLI and the driver loop, top to bottom.

    deepspeed --num_gpus 8 --module grpo_ds.train RECIPE.json [section.key=value ...]
    python -m grpo_ds.train RECIPE.json [section.key=value ...]
    grpo_ds.train("RECIPE.json", overrides={"train.steps": 10})   # returns the per-step metrics

One step: rollout -> reward -> plan -> old/ref log-probs -> advantage -> loss -> backward -> step
-> weight sync -> log. The advantage comes after the log-prob passes because KL-in-reward shaping needs
the reference log-probs. Rank 0 makes every global decision (prompts, rewards, the micro-batch plan,
advantages); every rank computes its shard. Everything the user can get wrong is checked
before a model loads or a file is written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

import torch

from grpo_ds import kernels
from grpo_ds.algo.shaping import kl_reward_penalty, overlong_penalty
from grpo_ds.config.deepspeed import rollout_shares_policy
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed import launcher
from grpo_ds.distributed.bridge import Bridge, Stalled
from grpo_ds.distributed.ranks import Dist, device_type, end_launched_rank, init_distributed
from grpo_ds.errors import UserError, exit_on_user_error
from grpo_ds.model import sequence_parallel
from grpo_ds.model.loading import load_model
from grpo_ds.model.policy import Policy, weights_sha256
from grpo_ds.reward_models.scorer import RewardModels
from grpo_ds.rewards.pool import RewardPool, worker_count
from grpo_ds.rollout.agent import AgentRolloutEngine
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.hf_compile import CompiledDecode, compile_wanted
from grpo_ds.run import checkpoint, output_paths, writes
from grpo_ds.run import folder as run_folder
from grpo_ds.run.host_allocator import return_large_frees
from grpo_ds.run.lock import RunLock
from grpo_ds.run.metrics import MetricsLogger, peak_memory_gib, read_metrics
from grpo_ds.run.preemption import Preempted, StopRequest, stop_on_signals, stop_word
from grpo_ds.run.preflight import Inputs, prepare_inputs
from grpo_ds.run.prompts import PromptSampler
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.evaluate import evaluate
from grpo_ds.step.loss import LossStats
from grpo_ds.step.plan import plan_recipe_step, token_imbalance
from grpo_ds.step.profiling import Phase, profiled_steps
from grpo_ds.step.schedule import Colocated, SplitTrainer, serve_rollouts
from grpo_ds.step.update import UpdateSettings, importance_metrics, logprob_pass, optimizer_step


def run(recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None = None) -> list[dict]:
    """Run a recipe to the end; return one metrics dict per step (on every rank). A Ctrl-C (SIGINT) stops it after
    the current step with a checkpoint and reaches the caller as KeyboardInterrupt; SIGTERM or SIGUSR1 as
    Preempted (grpo_ds/run/preemption.py)."""
    return _stoppable_run(recipe, overrides, leave_process=False)


def _stoppable_run(recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None,
                   leave_process: bool) -> list[dict]:
    """``run`` under the stop signals' handlers; ``leave_process``: the command line's (see StopRequest)."""
    try:
        with stop_on_signals(leave_process) as stop:
            return _run(recipe, overrides, stop)
    finally:
        sequence_parallel.restore()  # transformers' attention as it was, for whatever this process runs next


def _run(recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None, stop: StopRequest) -> list[dict]:
    # ---- 1. validate everything before any model loads or any file is written
    inputs = prepare_inputs(recipe, overrides, launcher.world_size(), device_type())
    recipe = inputs.recipe
    stop.set_grace(recipe.run.preempt_grace_s)  # a stop signal's deadline (grpo_ds/run/preemption.py)

    # ---- 2. processes, and the run folder's lock: one launch owns a run folder (a second one stops, writing nothing).
    # Split placement: the last rollout.ranks ranks only generate (grpo_ds.step.schedule.serve_rollouts)
    dist = init_distributed(recipe.train.tensor_parallel_size, recipe.train.sequence_parallel_size,
                            inputs.placement.rollout_ranks, recipe.rollout.transfer_timeout_s)
    output_paths.probe_on_rank_0(recipe, dist)  # every folder the run writes in, made and written once, then removed
    if dist.role == "rollout":
        try:
            return _generate(inputs, dist, stop)
        except UserError as err:  # e.g. reward.on_error "raise": launcher.say prints on the launch's rank 0 only
            if dist.is_main:
                launcher.say_on_each_rank(f"error: {err}")
            raise
        finally:
            if inputs.reward_pool is not None:
                inputs.reward_pool.close()
    lock = RunLock(run_folder.folder_path(recipe)) if dist.is_main else None
    dist.decide(_acquire, lock)  # rank 0 takes it; a live holder stops every rank with one line
    try:
        return _train(inputs, dist, stop)
    finally:
        if inputs.reward_pool is not None:
            inputs.reward_pool.close()
        if lock is not None:
            lock.release()


def _train(inputs: Inputs, dist: Dist, stop: StopRequest) -> list[dict]:
    recipe, tokenizer, prompts = inputs.recipe, inputs.tokenizer, inputs.prompts
    # fresh, resume, finished already, or refuse (another recipe's run, or data that changed under a resumed one)
    folder = run_folder.decide(recipe, inputs.data_identity)
    run_dir = folder.path
    stop.track(run_dir, None)  # what a step abandoned at a stop signal's deadline names
    if folder.completed_steps is not None:
        launcher.say(f"the run in {run_dir} has already finished its {folder.completed_steps} steps: nothing to do "
                     "(raise train.steps to continue it; run.overwrite=true or another run.name starts again)")
        return read_metrics(run_dir)  # the finished run's history, as grpo_ds.plot reads it

    run_folder.check_world_size(folder, recipe, inputs.ds_config, dist.world_size)  # a resume on another one
    # rank 0's reward workers start here, loading the functions while the models load (grpo_ds/rewards/pool.py);
    # _run closes them
    split = inputs.placement.split
    if dist.is_main and not split:
        _start_reward_pool(inputs)

    # ---- 3. the run folder, models
    dist.decide(run_folder.prepare, folder, recipe, inputs.ds_config, inputs.data_identity)  # rank 0 writes
    logger = _start_logger(recipe, run_dir, dist)  # W&B starts before the models load; a failure stops every rank
    torch.manual_seed(recipe.run.seed)
    # the rollout engine comes before the trainer (vLLM measures the free GPU memory), except one that generates with
    # the policy's own module (hf / agent where every rank holds it whole: no rollout copy, no weight sync); under
    # split placement the trainer's ranks hold none
    shared = rollout_shares_policy(recipe, inputs.ds_config)
    rollout = None if shared or split else _rollout_engine(recipe, inputs, dist)
    policy = Policy.build(recipe, inputs.ds_config, len(tokenizer), announce=dist.is_main)  # ZeRO-3: partitioned
    if shared and not split:
        rollout = _rollout_engine(recipe, inputs, dist, shared_module=policy.engine.module)
    # learned reward models: frozen, partitioned like the reference model, on every trainer rank (grpo_ds.reward_models)
    reward_models = RewardModels.build(inputs.reward_models, inputs.ds_config, dist, _reward_model_tokens(inputs),
                                       recipe.train.packing, announce=dist.is_main) if inputs.reward_models else None
    sampler = PromptSampler(len(prompts), recipe.run.seed, recipe.data.shuffle)
    rank_log = run_dir / "ranks" / f"rank{dist.rank}.jsonl"
    rank_log.parent.mkdir(parents=True, exist_ok=True)
    bucket_bytes = int(recipe.rollout.weight_sync_bucket_mb * 2**20)
    settings = UpdateSettings.from_recipe(recipe, tokenizer.pad_token_id, inputs.kernels_backend,
                                          policy.fused_lm_head_allowed, policy.packing_allowed, policy.packs_one_row)
    # the order of each step's phases across ranks (grpo_ds.step.schedule): who generates, and when weights travel
    schedule = _schedule(inputs, rollout, sampler, dist, bucket_bytes, reward_models)
    first_step, resumed_state, data_changed = _resume(folder, policy, sampler, logger, dist, rank_log)
    schedule.start(first_step - 1, policy, resumed_state, data_changed)
    nonfinite_in_a_row = 0

    for step in profiled_steps(range(first_step, recipe.train.steps + 1), recipe.logging, run_dir, dist):
        stop.track(run_dir, step)
        # ---- rollout and reward (grpo_ds.step.collect): rank 0 picks the prompts, every rank generates a slice,
        # rank 0 scores them; with dynamic sampling, equal-reward groups are replaced by new prompts. Under split
        # placement the rollout ranks did this, and the trainer's rank 0 receives it (grpo_ds.step.schedule)
        data = schedule.batch(step)

        # ---- plan: optimizer steps, per-rank shards, micro-batches (rank 0 decides)
        data.plan = dist.decide(plan_recipe_step, recipe, data.sequence_tokens(), dist.dp_size, step, settings.packed)

        # ---- old / reference log-probs, each pass with the log-prob phase's own micro size; from here to the end of
        # the update, freed tensors of 1 MiB and more go back to the system (grpo_ds/run/host_allocator.py)
        return_large_frees(True)
        with Phase("logprob", data.times, data.spans):
            if data.plan.old_logprob_pass:
                data.old_logprobs = logprob_pass(policy.engine, data, settings, dist)
            if policy.reference_engine is not None:
                with policy.reference() as reference:
                    data.ref_logprobs = logprob_pass(reference, data, settings, dist)

        # ---- advantage: shaped rewards (overlong penalty, KL in the reward) -> group advantages (rank 0)
        with Phase("advantage"):  # labelled for traces; not timed into time_step_s
            data.advantages, shaping_metrics = dist.decide(_advantages, recipe, inputs, data, dist.device)
        data.metrics.update(shaping_metrics)

        # ---- policy update: one optimizer step per mini-batch
        stats, grad_norms, nonfinite = LossStats(), [], 0
        with Phase("update", data.times, data.spans):
            for minibatch in data.plan.minibatches:
                step_stats, stepped = optimizer_step(policy.engine, data, minibatch, settings, dist)
                stats += step_stats
                # NaN guard: a non-finite loss skipped the update (optimizer_step); a non-finite norm is counted
                # too. Engines that report no norm (ZeRO stages 0-2 on some paths) give None: nothing to check.
                grad_norm = policy.engine.get_global_grad_norm() if stepped else math.nan
                if grad_norm is None or math.isfinite(grad_norm):
                    if grad_norm is not None:
                        grad_norms.append(float(grad_norm))
                    nonfinite_in_a_row = 0
                else:
                    nonfinite, nonfinite_in_a_row = nonfinite + 1, nonfinite_in_a_row + 1
                if nonfinite_in_a_row >= recipe.train.max_nonfinite_steps:
                    _stop_nonfinite(step, nonfinite_in_a_row, run_dir)
        return_large_frees(False)

        # ---- weight sync: ZeRO-3 shards -> full weights (LoRA: merged adapted layers), bucket by bucket, into the
        # rank's rollout engine (colocated) or to the rollout ranks that will generate with them (split)
        schedule.weights_changed(step, policy, data.times, data.spans)

        # ---- log
        stats = stats.summed_over_ranks(dist)
        metrics = data.metrics
        metrics.update(step=step, **_update_metrics(data, stats, grad_norms, nonfinite),
                       lr=policy.engine.get_lr()[0], skipped_rows=inputs.skipped_rows,
                       peak_memory_gib=peak_memory_gib(dist.device))
        if inputs.eval_prompts and (step % recipe.eval.every_steps == 0 or step == recipe.train.steps):
            with Phase("eval") as phase:
                metrics.update(evaluate(step, recipe, inputs, inputs.eval_prompts, rollout, dist, reward_models))
            metrics["time_eval_s"] = phase.seconds
        with checkpoint.run_file_writes(dist, run_dir, f"step {step}"):  # a failed write: one error on every rank
            logger.log(metrics)
            every = recipe.logging.samples_every_steps
            if dist.is_main and every is not None and (step % every == 0 or step == 1):
                logger.samples(step, _sample_records(inputs, data, recipe.logging.samples_per_log))
            _append_json(rank_log, {"step": step, "role": schedule.role, "weight_version": data.weight_version,
                                    "phases": data.spans, "trained_sample_ids": sorted(
                s for m in data.plan.minibatches for mb in m.micro_batches[dist.dp_rank] for s in mb)})

        # ---- checkpoint: atomically, every checkpoint.every_steps and after the last step
        # (never after a non-finite step: its weights may not be good)
        every, saved = recipe.checkpoint.every_steps, None
        trainer_state = {**schedule.in_flight(), "history": logger.history, "data": inputs.data_identity}
        if every is not None and (step % every == 0 or step == recipe.train.steps) and not nonfinite:
            with Phase("checkpoint"):
                saved = checkpoint.save(policy, run_dir, step, trainer_state, recipe.checkpoint.keep, dist)
        # ---- preemption: after a SIGTERM / SIGUSR1 on any rank (even one that came during the checkpoint above),
        # every rank stops here, with this step's checkpoint (grpo_ds/run/preemption.py)
        stop_signal = (stop.agreed(dist) or schedule.rollout_stop) if step < recipe.train.steps else None
        if stop_signal:
            if saved is None and not nonfinite:
                with Phase("checkpoint"):
                    saved = checkpoint.save(policy, run_dir, step, trainer_state, recipe.checkpoint.keep, dist)
            logger.close()
            stopped = Preempted(stop_signal, step, recipe.train.steps, saved and str(saved))
            schedule.stop(stopped)
            raise stopped
        stop.track(run_dir, None)

    # ---- the end: the final weights' hash on every rank (and the rollout copy's, which must equal it), the model
    save = dist.is_main and recipe.run.save_final_model
    digest, state = policy.final_weights(bucket_bytes, keep=save)
    final = {"final_weights_sha256": digest}
    if getattr(rollout, "model", None) is not None and not rollout.shares_policy_weights and not split:
        final["rollout_weights_sha256"] = weights_sha256(rollout.model.named_parameters())
    with checkpoint.run_file_writes(dist, run_dir, "end of the run"):  # a failed write: one error on every rank
        _append_json(rank_log, final)
        if save:
            with writes.writing(run_dir / "final_model"), writes.folder_written(run_dir / "final_model") as folder:
                policy.save_pretrained(folder, state, tokenizer)
        if dist.is_main:
            run_folder.mark_complete(run_dir, recipe.train.steps, digest)
    logger.close()
    schedule.finish(logger.history)  # split: the rollout ranks leave
    dist.barrier()
    if hasattr(rollout, "close"):  # vLLM: its shutdown takes the process group down, so it comes last
        rollout.close()
    return logger.history


# ----------------------------------------------------------------------------------------- phases

def _acquire(lock: RunLock) -> None:
    lock.acquire()


def _advantages(recipe: Recipe, inputs: Inputs, data: StepBatch, device: torch.device) -> tuple[list[float], dict]:
    """Rank 0: the reward shaping of the recipe, then group advantages (through the kernels backend)."""
    a, rollouts = recipe.algorithm, data.rollouts
    shaped = torch.tensor(data.rewards, dtype=torch.float32)  # (P*G,)
    metrics = {}
    if a.overlong_buffer_tokens is not None:
        penalty = overlong_penalty([len(r) for r in rollouts.response_ids], recipe.max_response_tokens,
                                   a.overlong_buffer_tokens, a.overlong_penalty)
        shaped += penalty
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    if a.kl_in_reward:
        ids = range(len(rollouts))
        penalty = kl_reward_penalty([data.old_logprobs[i] for i in ids], [data.ref_logprobs[i] for i in ids],
                                    [rollouts.token_loss_mask(i) for i in ids], a.kl_estimator, a.kl_coef)
        shaped += penalty
        metrics["reward/kl_penalty"] = penalty.mean().item()
    if a.rollout_is_cap is not None:
        metrics.update(importance_metrics(rollouts, data.old_logprobs, a.rollout_is_cap))
    baseline, scale = recipe.advantage_baseline_and_scale
    advantages = kernels.group_advantages(shaped.to(device), recipe.rollout.group_size, baseline, scale,
                                          backend=inputs.kernels_backend).cpu()
    return advantages.tolist(), metrics


def _update_metrics(data: StepBatch, stats: LossStats, grad_norms: list[float], nonfinite: int) -> dict:
    """The step's training metrics from the update's summed LossStats, the plan and the phase times (under split
    placement the step time is the trainer's own, ``wait`` included; the rollout ranks' times are
    ``rollout_side/time_*_s``)."""
    rollouts, plan, times = data.rollouts, data.plan, data.times
    side = data.rollout_side or {}
    generating = side.get("times", times)
    response_lengths = [len(r) for r in rollouts.response_ids]
    sequence_tokens = data.sequence_tokens()
    return dict(
        loss=stats.loss / len(plan.minibatches), kl=stats.kl / stats.response_tokens,
        entropy=stats.entropy / stats.response_tokens, clip_frac=stats.clipped_tokens / stats.response_tokens,
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        nonfinite_optimizer_steps=nonfinite, **stats.router_metrics(),
        response_len_mean=sum(response_lengths) / len(response_lengths),
        stop_frac=rollouts.finish_reason.count("stop") / len(rollouts),
        optimizer_steps=len(plan.minibatches),
        padding_micro_batches=sum(m.padding_micro_batches() for m in plan.minibatches),
        token_imbalance=max(token_imbalance(m, sequence_tokens) for m in plan.minibatches),
        tokens_per_s=stats.sequence_tokens / times["update"],
        generated_tokens_per_s=sum(response_lengths) / generating["rollout"],
        time_step_s=sum(times.values()), **{f"time_{k}_s": v for k, v in times.items()},
        **({f"rollout_side/time_{k}_s": v for k, v in side["times"].items()} if side else {}),
        **({"placement/trainer_idle_s": times.get("wait", 0.0),
            "placement/trainer_busy_s": sum(times.values()) - times.get("wait", 0.0)} if side else {}))


def _sample_records(inputs: Inputs, data: StepBatch, count: int) -> list[dict]:
    rollouts, G = data.rollouts, inputs.recipe.rollout.group_size
    return [{"prompt": inputs.prompts[data.prompt_index[i // G]].prompt_text,
             "completion": inputs.tokenizer.decode(rollouts.response_ids[i], skip_special_tokens=True),
             "reward": data.rewards[i]} for i in range(min(count, len(rollouts)))]


def _stop_nonfinite(step: int, count: int, run_dir: Path) -> None:
    good = checkpoint.complete_checkpoints(run_dir)
    raise UserError(f"step {step}", f"{count} optimizer steps in a row had a non-finite loss or gradient norm "
                    "(their updates were skipped)", f"the last good checkpoint is {good[0] if good else 'none'}; "
                    "lower train.lr, check the rewards and the data, or raise train.max_nonfinite_steps")


def _resume(folder: run_folder.RunFolder, policy: Policy, sampler: PromptSampler, logger: MetricsLogger, dist: Dist,
            rank_log: Path) -> tuple[int, dict | None, bool]:
    """Restore the newest good checkpoint (or the one checkpoint.resume names); return the first step to run, the
    checkpoint's trainer state (None: a fresh start) and whether data.train changed since it was written."""
    if folder.checkpoint is not None:
        path = folder.checkpoint
    elif folder.fresh:
        return 1, None, False
    else:
        path, damaged = checkpoint.choose(folder.path) if dist.is_main else (None, [])
        for message in damaged:
            launcher.say(f"warning: {message}")
        path = dist.broadcast(path)
    if path is None:  # the run stopped before its first checkpoint: it starts over
        _trim_logs(folder.path, rank_log, 0, dist)
        return 1, None, False
    resumed = checkpoint.load(policy, path, dist)
    changed = folder.data_changed is not None
    sampler.load_state_dict(resumed.trainer_state["sampler"], data_changed=changed)
    if folder.data_changed:
        launcher.say(f"note: data.train changed since the run started ({folder.data_changed}); data.on_change is "
                     '"continue": a new pass over the changed data begins')
    logger.resume(resumed.trainer_state["history"])
    _trim_logs(folder.path, rank_log, resumed.step, dist)
    launcher.say(f"resuming after step {resumed.step} from {path}")
    dist.barrier()
    return resumed.step + 1, resumed.trainer_state, changed


def _generate(inputs: Inputs, dist: Dist, stop: StopRequest) -> list[dict]:
    """A rollout rank of a split placement, from start to end: its engine, the reward workers on the first of them,
    and the rollout side of the schedule (grpo_ds.step.schedule.serve_rollouts). No lock, no run files but its log."""
    recipe = inputs.recipe
    if dist.is_main:
        _start_reward_pool(inputs)
    torch.manual_seed(recipe.run.seed)
    engine = _rollout_engine(recipe, inputs, dist)
    bridge = Bridge(dist.store, 1 + dist.rank, inputs.placement.rollout_ranks + 1, dist.device,
                    recipe.rollout.transfer_timeout_s)
    rank_log = run_folder.folder_path(recipe) / "ranks" / f"rank{dist.launch_rank}.jsonl"
    stop.track(run_folder.folder_path(recipe), None)
    history = serve_rollouts(recipe, inputs, dist, bridge, engine, stop, rank_log)
    if hasattr(engine, "close"):
        engine.close()
    return history


def _schedule(inputs: Inputs, rollout, sampler: PromptSampler, dist: Dist, bucket_bytes: int,
              reward_models: RewardModels | None) -> Colocated | SplitTrainer:
    """The trainer's side of the step's phase order: colocated, or split (rank 0 holds the bridge)."""
    recipe, placement = inputs.recipe, inputs.placement
    if not placement.split:
        return Colocated(recipe, inputs, rollout, sampler, dist, bucket_bytes, reward_models)
    bridge = Bridge(dist.store, 0, placement.rollout_ranks + 1, dist.device, recipe.rollout.transfer_timeout_s) \
        if dist.is_main else None
    return SplitTrainer(recipe, inputs, dist, bridge, bucket_bytes, reward_models)


def _reward_model_tokens(inputs: Inputs) -> int:
    """The token budget of one reward-model micro-batch: the planner's (train.max_tokens_per_micro_batch), else the
    log-prob phase's samples per micro-batch times the longest prompt + response."""
    t = inputs.recipe.train
    longest = max(len(p.prompt_ids) for p in inputs.prompts) + inputs.recipe.max_response_tokens
    return t.max_tokens_per_micro_batch or t.logprob_micro_batch_samples_per_gpu * longest


def _start_reward_pool(inputs: Inputs) -> None:
    """The reward workers (grpo_ds/rewards/pool.py) on the rank that scores: they load the functions while the models
    load; _run closes them."""
    r = inputs.recipe.reward
    processes = worker_count(r.processes)
    if processes and r.functions:
        inputs.reward_pool = RewardPool(r.functions, processes, r.worker_memory_gib)


def _start_logger(recipe: Recipe, run_dir: Path, dist: Dist) -> MetricsLogger:
    """The metrics logger (rank 0 writes metrics.jsonl and starts TensorBoard / W&B). A sink that cannot start raises
    on every rank, so that no rank is left waiting for rank 0 in a collective."""
    logger, failure = None, None
    try:
        logger = MetricsLogger(run_dir if dist.is_main else None, recipe.train.steps, recipe.logging,
                               recipe.run.name, recipe.to_dict())
    except UserError as err:
        failure = err
    writes.agree(dist, failure)
    return logger


def _trim_logs(run_dir: Path, rank_log: Path, last_step: int, dist: Dist) -> None:
    """metrics.jsonl (rank 0) and each rank's own log cut back to ``last_step``; a write that fails on any rank
    stops every rank with one error."""
    with checkpoint.run_file_writes(dist, run_dir, "resume"):
        run_folder.trim_log(rank_log, last_step)
        if dist.is_main:
            run_folder.trim_metrics(run_dir, last_step)
    dist.barrier()


def _rollout_engine(recipe: Recipe, inputs: Inputs, dist: Dist, shared_module: torch.nn.Module | None = None):
    """The rollout engine: hf and agent generate with ``shared_module`` (the policy's own, where every rank holds it
    whole: grpo_ds.config.deepspeed.rollout_shares_policy) or else with an unsharded copy of the policy, loaded here
    (the one full copy a rank holds); vLLM loads its own weights from model.path and gets no copy."""
    r, tokenizer = recipe.rollout, inputs.tokenizer
    if recipe.uses_vllm:  # vLLM is imported only when chosen (an optional extra)
        from grpo_ds.rollout.vllm import VLLMRolloutEngine, VLLMSettings

        engine = VLLMRolloutEngine(VLLMSettings.from_recipe(recipe), tokenizer,
                                   lambda: load_model(recipe.model, len(tokenizer), recipe.run.seed))
        if r.engine == "agent":  # the agent engine's turns from vLLM
            return AgentRolloutEngine(engine, tokenizer, inputs.env_factory, r.max_turns, recipe.max_response_tokens,
                                      r.generation_batch_prompts)
        return engine
    shared = shared_module is not None
    model = shared_module if shared else load_model(recipe.model, len(tokenizer), recipe.run.seed).to(dist.device)
    if recipe.train.sequence_parallel_size > 1:  # Ulysses replaces the policy's attention process-wide
        sequence_parallel.keep_out(model)
    if r.engine == "agent":
        return AgentRolloutEngine.on_hf(model, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer,
                                        inputs.env_factory, r.max_turns, recipe.max_response_tokens,
                                        r.generation_batch_prompts, shared)
    compiled = (CompiledDecode(dist.device, r.hf_compile_timeout_s) if compile_wanted(r.hf_compile, dist.device)
                else None)  # rollout.hf_compile
    return HFRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, r.generation_batch_prompts, shared,
                           compiled)


# ------------------------------------------------------------------------------------ plumbing

def _append_json(path: Path, record: dict) -> None:
    writes.append_line(path, json.dumps(record))


# ----------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="grpo_ds.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="path to a recipe JSON file")
    parser.add_argument("overrides", nargs="*", help="section.key=value (value parsed as JSON when it parses)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    args = parser.parse_intermixed_args(argv)
    code, stopped = 0, False
    try:
        with exit_on_user_error():
            _stoppable_run(args.recipe, args.overrides, leave_process=True)
    except Preempted as signalled:  # SIGTERM / SIGUSR1: 75; Ctrl-C: 130 (grpo_ds/run/preemption.py)
        launcher.say(f"{stop_word(signalled.signal_name)}: {signalled}")
        code, stopped = signalled.exit_code, True
    except Stalled as stalled:  # split placement: the side that waited in vain says which side stalled
        launcher.say_on_each_rank(f"error: {stalled}")
        code = 1
    except SystemExit as leaving:  # exit_on_user_error's one-line error
        code = 0 if leaving.code is None else leaving.code if isinstance(leaving.code, int) else 1
    end_launched_rank(code, stopped)  # a launched or stopped rank leaves here (see there); else exits as before
    if code:
        sys.exit(code)


class _CallableModule(types.ModuleType):
    """Lets `grpo_ds.train(...)` be called although `grpo_ds.train` is also the CLI module."""

    def __call__(self, recipe: str | Path | dict | Recipe, overrides: list[str] | dict | None = None) -> list[dict]:
        return run(recipe, overrides)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
