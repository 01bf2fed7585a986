"""Clipped surrogate policy loss, per token.

With ratio = pi(y_t) / pi_old(y_t) = exp(logprob - old_logprob) and advantage A of the token's sequence:

    loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))

PPO (Schulman et al. 2017, arXiv:1707.06347) uses clip_low = clip_high; the separate upper bound
("clip-higher", e.g. clip_high = 0.28) is from DAPO (Yu et al. 2025, arXiv:2503.14476). Minimising the
max is maximising PPO's pessimistic min of the two surrogates. Where the clipped term is selected the ratio
lies outside the clip range and the token's gradient is 0; elsewhere d loss_t / d logprob = -A * ratio.
Only ``logprobs`` receives gradient; old log-probs and advantages are treated as constants.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (per_token_loss, clipped), both shaped like ``logprobs``.

    ``clipped`` is 1.0 where the clipped term was strictly larger (the clip changed the loss), else 0.0.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape):
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
                         f"advantages {tuple(advantages.shape)} must have the same shape (broadcast the "
                         "advantages per token first)")
    advantages = advantages.detach()
    ratio = torch.exp(logprobs - old_logprobs.detach())  # (...)
    unclipped_loss = -advantages * ratio  # (...)
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (...)
    is_clipped = clipped_loss > unclipped_loss  # (...) bool
    # where (not maximum): maximum splits the gradient between equal arguments; here the selection is explicit.
    per_token_loss = torch.where(is_clipped, clipped_loss, unclipped_loss)  # (...)
    return per_token_loss, is_clipped.to(per_token_loss.dtype)
