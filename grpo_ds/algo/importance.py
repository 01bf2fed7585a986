"""Rollout importance correction: the sampler is not exactly the policy being trained.

The rollout engine samples token y_t with probability pi_sampler(y_t) (another kernel, another
precision, or vLLM), while the loss assumes pi_old(y_t), the trainer's own probability under the
same weights. Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl) weights each token's
loss by

    w_t = min(pi_old(y_t) / pi_sampler(y_t), cap) = min(exp(old_logprob_t - sampler_logprob_t), cap)

which corrects the mismatch in expectation while the cap bounds the variance. The weight is a
constant (no gradient flows through it).
"""

from __future__ import annotations

import math

import torch


def truncated_importance_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """w_t (same shape as the inputs), detached; ``cap`` >= 1."""
    if old_logprobs.shape != sampler_logprobs.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)} and sampler_logprobs "
            f"{tuple(sampler_logprobs.shape)} must have the same shape"
        )
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    log_ratio = (old_logprobs.detach() - sampler_logprobs.detach()).clamp(max=math.log(cap))
    return torch.exp(log_ratio)
