"""Clipped surrogate policy loss, per token, and the full per-token training loss.

With ratio = pi(y_t) / pi_old(y_t) = exp(logprob - old_logprob) and advantage A of the token's sequence:

    loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    dual clip (A < 0 only):  loss_t = min(loss_t, -dual_clip * A)

PPO (Schulman et al. 2017, arXiv:1707.06347) uses clip_low = clip_high; the separate upper bound
("clip-higher", e.g. clip_high = 0.28) is from DAPO (Yu et al. 2025, arXiv:2503.14476). Minimising the
max is maximising PPO's pessimistic min of the two surrogates. Dual clip (Ye et al. 2020, arXiv:1912.09729)
bounds the loss of a negative-advantage token whose ratio has grown very large (dual_clip > 1, often 3).
Where a clipped term is selected the token's gradient is 0; elsewhere d loss_t / d logprob = -A * ratio.
Only ``logprobs`` receives gradient; old log-probs and advantages are treated as constants.

The training loss of one token adds the KL penalty and subtracts the entropy bonus:

    l_t = loss_t + kl_coef * KL_t(estimator) - entropy_coef * H_t
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_ds.algo.kl import kl_penalty


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float, dual_clip: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (per_token_loss, clipped), both shaped like ``logprobs``.

    ``clipped`` is 1.0 where a clip (ratio clip or dual clip) changed the loss, else 0.0.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape):
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
                         f"advantages {tuple(advantages.shape)} must have the same shape (broadcast the "
                         "advantages per token first)")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    advantages = advantages.detach()
    ratio = torch.exp(logprobs - old_logprobs.detach())  # (...)
    unclipped_loss = -advantages * ratio  # (...)
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (...)
    is_clipped = clipped_loss > unclipped_loss  # (...) bool
    # where (not maximum): maximum splits the gradient between equal arguments; here the selection is explicit.
    per_token_loss = torch.where(is_clipped, clipped_loss, unclipped_loss)  # (...)
    if dual_clip is not None:
        bound = -dual_clip * advantages  # (...), positive where A < 0
        use_bound = (advantages < 0) & (bound < per_token_loss)  # (...) bool
        per_token_loss = torch.where(use_bound, bound, per_token_loss)
        is_clipped = is_clipped | use_bound
    return per_token_loss, is_clipped.to(per_token_loss.dtype)


@dataclass(frozen=True)
class LossConfig:
    """Everything that shapes the per-token loss l_t (see the module docstring)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


def token_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                 ref_logprobs: torch.Tensor | None, entropy: torch.Tensor | None, cfg: LossConfig
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (l_t, KL_t, clipped_t), each shaped like ``logprobs``.

    ``old_logprobs`` None means on-policy (the policy has not changed since sampling): old = logprobs detached,
    so the ratio is exactly 1. ``ref_logprobs`` None means no reference model: KL_t = 0 (kl_coef must then be 0
    for the loss to make sense, which the recipe guarantees). ``entropy`` None means no entropy bonus.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    loss, clipped = ppo_clip_loss(logprobs, old, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator)  # (...)
        loss = loss + cfg.kl_coef * kl
    else:
        kl = torch.zeros_like(loss)
    if entropy is not None and cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * entropy
    return loss, kl, clipped
