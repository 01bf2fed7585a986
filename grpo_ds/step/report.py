"""What a step reports: its metrics (metrics.jsonl, TensorBoard, W&B), sample completions, and the
rank's own log.

``step_metrics`` completes the step's metrics from the update's summed LossStats, the NaN guard, the
plan and the phase times; ``write_step`` writes them (rank 0), the sampled completions every
``logging.samples_every_steps`` steps, and this rank's record in ranks/rank<N>.jsonl (its role, the
weight version its samples were drawn with, its phase spans and the samples it trained). A write
that fails on any rank stops every rank with one error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from grpo_ds.run import checkpoint, writes
from grpo_ds.run.metrics import peak_memory_gib
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.context import StepContext
from grpo_ds.step.guard import NonfiniteGuard
from grpo_ds.step.loss import LossStats
from grpo_ds.step.plan import token_imbalance


def step_metrics(
    ctx: StepContext, step: int, data: StepBatch, stats: LossStats, guard: NonfiniteGuard, lr: float
) -> dict:
    """``data.metrics`` completed with the step's training metrics (``stats`` summed over the
    ranks)."""
    metrics = data.metrics
    metrics.update(
        step=step,
        **update_metrics(data, stats, guard.grad_norms, guard.nonfinite),
        lr=lr,
        skipped_rows=ctx.inputs.skipped_rows,
        peak_memory_gib=peak_memory_gib(ctx.dist.device),
    )
    return metrics


def update_metrics(
    data: StepBatch, stats: LossStats, grad_norms: list[float], nonfinite: int
) -> dict:
    """The step's training metrics from the update's summed LossStats, the plan and the phase times
    (under split placement the step time is the trainer's own, ``wait`` included; the rollout ranks'
    times are ``rollout_side/time_*_s``)."""
    rollouts, plan, times = data.rollouts, data.plan, data.times
    side = data.rollout_side or {}
    generating = side.get("times", times)
    response_lengths = [len(r) for r in rollouts.response_ids]
    sequence_tokens = data.sequence_tokens()
    return dict(
        loss=stats.loss / len(plan.minibatches),
        kl=stats.kl / stats.response_tokens,
        entropy=stats.entropy / stats.response_tokens,
        clip_frac=stats.clipped_tokens / stats.response_tokens,
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        nonfinite_optimizer_steps=nonfinite,
        **stats.router_metrics(),
        response_len_mean=sum(response_lengths) / len(response_lengths),
        response_len_max=max(response_lengths),
        stop_frac=rollouts.finish_reason.count("stop") / len(rollouts),
        optimizer_steps=len(plan.minibatches),
        padding_micro_batches=sum(m.padding_micro_batches() for m in plan.minibatches),
        token_imbalance=max(token_imbalance(m, sequence_tokens) for m in plan.minibatches),
        tokens_per_s=stats.sequence_tokens / times["update"],
        # continuous generation decodes several steps at once: a batch may come with no decoding
        # of its own since the one before (its rollout/tokens_per_s is the engine's rate)
        generated_tokens_per_s=sum(response_lengths) / generating["rollout"]
        if generating.get("rollout")
        else math.nan,
        time_step_s=sum(times.values()),
        **{f"time_{k}_s": v for k, v in times.items()},
        **({f"rollout_side/time_{k}_s": v for k, v in side["times"].items()} if side else {}),
        **(
            {
                "placement/trainer_idle_s": times.get("wait", 0.0),
                "placement/trainer_busy_s": sum(times.values()) - times.get("wait", 0.0),
            }
            if side
            else {}
        ),
    )


def write_step(ctx: StepContext, step: int, data: StepBatch, role: str, rank_log: Path) -> None:
    """The step's metrics (rank 0 through the logger), its sampled completions when due, this rank's
    log record."""
    dist, every = ctx.dist, ctx.recipe.logging.samples_every_steps
    # a failed write: one error on every rank
    with checkpoint.run_file_writes(dist, ctx.run_dir, f"step {step}"):
        ctx.logger.log(data.metrics)
        if dist.is_main and every is not None and (step % every == 0 or step == 1):
            ctx.logger.samples(step, sample_records(ctx, data, ctx.recipe.logging.samples_per_log))
        trained = sorted(
            s for m in data.plan.minibatches for mb in m.micro_batches[dist.dp_rank] for s in mb
        )
        append_json(
            rank_log,
            {
                "step": step,
                "role": role,
                "weight_version": data.weight_version,
                "phases": data.spans,
                "trained_sample_ids": trained,
            },
        )


def sample_records(ctx: StepContext, data: StepBatch, count: int) -> list[dict]:
    """The first ``count`` samples of the step: prompt, completion text and reward."""
    inputs, rollouts, G = ctx.inputs, data.rollouts, ctx.group_size
    return [
        {
            "prompt": inputs.prompts[data.prompt_index[i // G]].prompt_text,
            "completion": inputs.tokenizer.decode(
                rollouts.response_ids[i], skip_special_tokens=True
            ),
            "reward": data.rewards[i],
        }
        for i in range(min(count, len(rollouts)))
    ]


def append_json(path: Path, record: dict) -> None:
    writes.append_line(path, json.dumps(record))
