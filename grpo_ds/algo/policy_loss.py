"""Clipped surrogate policy loss, per token, and the full per-token training loss.

With ratio = pi(y_t) / pi_old(y_t) = exp(logprob - old_logprob) and advantage A of the token's
sequence:

    loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    dual clip (A < 0 only):  loss_t = min(loss_t, -dual_clip * A)

PPO (Schulman et al. 2017, arXiv:1707.06347) uses clip_low = clip_high; the separate upper bound
("clip-higher", e.g. clip_high = 0.28) is from DAPO (Yu et al. 2025, arXiv:2503.14476). Minimising
the max is maximising PPO's pessimistic min of the two surrogates. Dual clip (Ye et al. 2020,
arXiv:1912.09729) bounds the loss of a negative-advantage token whose ratio has grown very large
(dual_clip > 1, often 3). Where a clipped term is selected the token's gradient is 0; elsewhere d
loss_t / d logprob = -A * ratio. Only ``logprobs`` receives gradient; old log-probs and advantages
are treated as constants.

GSPO (Zheng et al. 2025, arXiv:2507.18071) replaces the token ratio by the sequence's
length-normalised ratio s_i = exp(mean_t (logprob_t - old_logprob_t)) over its trained tokens,
clipped the same way (with much smaller clip ranges, ~3e-4 / 4e-4 in the paper). Its token-level
form s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] has the value s_i and d s_it / d logprob_t = s_i, so
with seq-mean-token-mean aggregation the gradient is exactly GSPO's sequence-level one; the sequence
is clipped as a whole (all its tokens or none).

The training loss of one token adds the KL penalty and subtracts the entropy bonus:

    l_t = loss_t + kl_coef * KL_t(estimator) - entropy_coef * H_t
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpo_ds.algo.kl import kl_penalty
from grpo_ds.algo.names import POLICY_LOSSES

if TYPE_CHECKING:  # read, never imported: the formulas import nothing of the recipe
    from grpo_ds.config.recipe import AlgorithmConfig


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (per_token_loss, clipped), both shaped like ``logprobs``.

    ``clipped`` is 1.0 where a clip (ratio clip or dual clip) changed the loss, else 0.0.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"advantages {tuple(advantages.shape)} must have the same shape (broadcast the "
            "advantages per token first)"
        )
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    advantages = advantages.detach()
    ratio = torch.exp(logprobs - old_logprobs.detach())  # (...)
    unclipped_loss = -advantages * ratio  # (...)
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (...)
    is_clipped = clipped_loss > unclipped_loss  # (...) bool
    # where (not maximum): maximum splits the gradient between equal arguments; here the selection
    # is explicit.
    per_token_loss = torch.where(is_clipped, clipped_loss, unclipped_loss)  # (...)
    if dual_clip is not None:
        bound = -dual_clip * advantages  # (...), positive where A < 0
        use_bound = (advantages < 0) & (bound < per_token_loss)  # (...) bool
        per_token_loss = torch.where(use_bound, bound, per_token_loss)
        is_clipped = is_clipped | use_bound
    return per_token_loss, is_clipped.to(per_token_loss.dtype)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    token_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO per-token loss over flat tokens: (per_token_loss, clipped), both shaped like
    ``logprobs`` (N,).

    ``seq_index`` (N,) says which sequence each token belongs to; ``token_mask`` (N,) is nonzero for
    the tokens that count in the sequence ratio (observation tokens of a multi-turn rollout do not).
    """
    if not (
        logprobs.shape
        == old_logprobs.shape
        == advantages.shape
        == seq_index.shape
        == token_mask.shape
    ):
        raise ValueError(
            "logprobs, old_logprobs, advantages, seq_index and token_mask must all be (N,)"
        )
    counted = (token_mask != 0).to(torch.float64)  # (N,)
    num_seqs = int(seq_index.max()) + 1 if seq_index.numel() else 0
    # (N,)
    diff = torch.where(
        token_mask != 0, (logprobs.detach() - old_logprobs.detach()).to(torch.float64), 0.0
    )
    sums = torch.zeros(num_seqs, dtype=torch.float64, device=logprobs.device).index_add_(
        0, seq_index, diff
    )
    counts = torch.zeros(num_seqs, dtype=torch.float64, device=logprobs.device).index_add_(
        0, seq_index, counted
    )
    seq_log_ratio = (sums / counts.clamp(min=1)).to(logprobs.dtype)  # (S,)
    # (N,) value s_i, gradient s_i
    ratio = torch.exp(seq_log_ratio[seq_index] + logprobs - logprobs.detach())
    advantages = advantages.detach()
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    is_clipped = clipped_loss > unclipped_loss
    per_token_loss = torch.where(is_clipped, clipped_loss, unclipped_loss)
    return per_token_loss, is_clipped.to(per_token_loss.dtype)


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Everything that shapes the per-token loss l_t (see the module docstring). No field has a
    default: the recipe's schema holds them (grpo_ds.config.recipe.AlgorithmConfig), and
    ``from_recipe`` reads them from it."""

    clip_low: float  # ratio >= 1 - clip_low
    clip_high: float  # ratio <= 1 + clip_high
    dual_clip: float | None  # None: no dual clip
    kl_coef: float  # the KL term's weight in l_t (0 where the KL goes into the reward instead)
    kl_estimator: str  # "k1", "k2" or "k3" (grpo_ds.algo.kl)
    entropy_coef: float
    policy_loss: str  # "ppo_clip" or "gspo" (needs the sequence layout: see token_losses)

    @classmethod
    def from_recipe(cls, algorithm: AlgorithmConfig) -> LossConfig:
        """The loss the recipe's ``algorithm`` section asks for. With ``kl_in_reward`` the KL is
        subtracted from the reward before the advantages (grpo_ds.algo.shaping), so the loss has no
        KL term."""
        a = algorithm
        return cls(
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip=a.dual_clip,
            kl_coef=0.0 if a.kl_in_reward else a.kl_coef,
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
            policy_loss=a.policy_loss,
        )


def token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    cfg: LossConfig,
    sequences: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (l_t, KL_t, clipped_t), each shaped like ``logprobs``.

    ``old_logprobs`` None means on-policy (the policy has not changed since sampling): old =
    logprobs detached, so the ratio is exactly 1. ``ref_logprobs`` None means no reference model:
    KL_t = 0 (kl_coef must then be 0 for the loss to make sense, which the recipe guarantees).
    ``entropy`` None means no entropy bonus. ``sequences`` = (seq_index, token_mask), flat (N,)
    tensors, is required by GSPO (see ``gspo_loss``).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    if cfg.policy_loss == "gspo":
        if sequences is None:
            raise ValueError(
                "the gspo policy loss needs sequences=(seq_index, "
                "token_mask) for its sequence ratio"
            )
        loss, clipped = gspo_loss(
            logprobs, old, advantages, *sequences, cfg.clip_low, cfg.clip_high
        )
    elif cfg.policy_loss == "ppo_clip":
        loss, clipped = ppo_clip_loss(
            logprobs, old, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip
        )
    else:
        raise ValueError(
            f"unknown policy loss {cfg.policy_loss!r}; choose one of {', '.join(POLICY_LOSSES)}"
        )
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator)  # (...)
        loss = loss + cfg.kl_coef * kl
    else:
        kl = torch.zeros_like(loss)
    if entropy is not None and cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * entropy
    return loss, kl, clipped
