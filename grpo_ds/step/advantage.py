"""The advantage phase: the recipe's reward shaping, then group advantages (rank 0 decides, every
rank receives).

It comes after the log-prob passes because KL-in-reward shaping needs the reference log-probs.
Shaping: DAPO's overlong penalty (grpo_ds.algo.shaping.overlong_penalty) and the KL penalty in the
reward (grpo_ds.algo.shaping.kl_reward_penalty); the advantages through the kernels backend
(grpo_ds.kernels.group_advantages, whose reference is grpo_ds.algo.advantages).
"""

from __future__ import annotations

import torch

from grpo_ds import kernels
from grpo_ds.algo.shaping import kl_reward_penalty, overlong_penalty
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.context import StepContext
from grpo_ds.step.update import importance_metrics


def add_advantages(ctx: StepContext, data: StepBatch) -> None:
    """Every rank: ``data.advantages`` and the shaping's metrics, as rank 0 computed them."""
    data.advantages, shaping_metrics = ctx.dist.decide(advantages, ctx, data)
    data.metrics.update(shaping_metrics)


def advantages(ctx: StepContext, data: StepBatch) -> tuple[list[float], dict]:
    """Rank 0: the reward shaping of the recipe, then group advantages (through the kernels
    backend)."""
    recipe = ctx.recipe
    a, rollouts = recipe.algorithm, data.rollouts
    shaped = torch.tensor(data.rewards, dtype=torch.float32)  # (P*G,)
    metrics = {}
    if a.overlong_buffer_tokens is not None:
        penalty = overlong_penalty(
            [len(r) for r in rollouts.response_ids],
            recipe.max_response_tokens,
            a.overlong_buffer_tokens,
            a.overlong_penalty,
        )
        shaped += penalty
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    if a.kl_in_reward:
        ids = range(len(rollouts))
        penalty = kl_reward_penalty(
            [data.old_logprobs[i] for i in ids],
            [data.ref_logprobs[i] for i in ids],
            [rollouts.token_loss_mask(i) for i in ids],
            a.kl_estimator,
            a.kl_coef,
        )
        shaped += penalty
        metrics["reward/kl_penalty"] = penalty.mean().item()
    if a.rollout_is_cap is not None:
        metrics.update(importance_metrics(rollouts, data.old_logprobs, a.rollout_is_cap))
    baseline, scale = recipe.advantage_baseline_and_scale
    advantages = kernels.group_advantages(
        shaped.to(ctx.dist.device),
        recipe.rollout.group_size,
        baseline,
        scale,
        backend=ctx.inputs.kernels_backend,
    ).cpu()
    return advantages.tolist(), metrics
