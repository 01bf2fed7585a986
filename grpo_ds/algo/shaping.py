"""Reward shaping applied to the reward functions' total before advantages.

Soft overlong penalty (DAPO, Yu et al. 2025, arXiv:2503.14476, "overlong reward shaping"): with
L_max the length limit and a buffer of B tokens before it, a completion of length L gets

    0                               if L <= L_max - B
    -penalty * (L - (L_max - B)) / B  if L_max - B < L <= L_max      (linear over the buffer)
    -penalty                        if L > L_max

KL in the reward (the RLHF/PPO form, e.g. Ouyang et al. 2022, arXiv:2203.02155; REINFORCE++):
instead of a KL term in the loss, a completion's reward is reduced by kl_coef * sum_t KL_t over its
trained tokens, KL_t from the chosen estimator (grpo_ds.algo.kl) with the policy's log-probs at
sampling time.
"""

from __future__ import annotations

import torch

from grpo_ds.algo.kl import kl_penalty


def overlong_penalty(
    lengths: list[int] | torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float
) -> torch.Tensor:
    """Per-completion reward change (N,) float32, <= 0."""
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(
            f"buffer_tokens must be in [1, max_tokens={max_tokens}], got {buffer_tokens}"
        )
    lengths = torch.as_tensor(lengths, dtype=torch.float32)  # (N,)
    start = max_tokens - buffer_tokens
    inside = -penalty * (lengths - start) / buffer_tokens  # (N,)
    return torch.where(
        lengths <= start,
        torch.zeros_like(lengths),
        torch.where(lengths <= max_tokens, inside, torch.full_like(lengths, -penalty)),
    )


def kl_reward_penalty(
    logprobs: list[torch.Tensor],
    ref_logprobs: list[torch.Tensor],
    masks: list[list[int]],
    estimator: str,
    kl_coef: float,
) -> torch.Tensor:
    """Per-completion reward change (N,) float32: -kl_coef * sum over the trained tokens of KL_t."""
    out = []
    for lp, ref, mask in zip(logprobs, ref_logprobs, masks, strict=True):
        keep = torch.tensor(mask, dtype=torch.bool)  # (L_i,)
        out.append(-kl_coef * kl_penalty(lp.float(), ref.float(), estimator)[keep].sum())
    return torch.stack(out) if out else torch.zeros(0)
