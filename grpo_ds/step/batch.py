"""One step's data, in the order the driver fills it: samples and rewards (grpo_ds.step.collect),
the plan, the old and reference log-probs, the advantages; plus the step's metrics and phase times,
which every phase adds to."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_ds.rollout.base import Rollouts
from grpo_ds.step.plan import StepPlan

PerSample = dict[int, torch.Tensor]  # {sample id: (L_i,) float32 per response token}


@dataclass
class StepBatch:
    prompt_index: list[int]  # (P,) dataset rows of the groups, in order
    rollouts: Rollouts  # P*G samples, the G of a prompt consecutive
    rewards: list[float]  # (P*G,) reward functions' weighted total plus environment rewards
    metrics: dict = field(default_factory=dict)  # this step's metrics so far
    # seconds per phase ("rollout", "reward", "logprob", ...)
    times: dict = field(default_factory=dict)
    plan: StepPlan | None = None  # optimizer steps, per-rank shards, micro-batches
    old_logprobs: PerSample | None = None  # None: no old-log-prob pass (old = current, detached)
    ref_logprobs: PerSample | None = None  # None: no reference model
    advantages: list[float] | None = None  # (P*G,) after reward shaping
    # [phase, start, end] (time.time()) of this rank's phases
    spans: list = field(default_factory=list)
    # split placement: the optimizer step whose weights sampled it (0: initial)
    weight_version: int | None = None
    # split placement: the rollout ranks' phase times ("rollout", "reward") and spans
    rollout_side: dict | None = None

    def sequence_tokens(self) -> list[int]:
        """Prompt + response tokens of every sample."""
        return [
            len(p) + len(r)
            for p, r in zip(self.rollouts.prompt_ids, self.rollouts.response_ids, strict=True)
        ]
