"""The per-token math behind one backend switch: Triton kernels on CUDA, the chunked PyTorch path
elsewhere.

Public operations (each has a Triton kernel and a chunked PyTorch path; both follow grpo_ds/algo
exactly):

    group_advantages         rewards (P*G,) -> advantages (P*G,)
    logprobs_from_logits     logits (M, V), target ids -> per-token log-prob and entropy   (fwd +
                             bwd)
    logprobs_from_hidden     hidden (N, H) and lm_head weight (V, H) -> the same, full logits never
                             exist
    policy_loss_from_hidden  hidden, weight, loss inputs -> sum_t w_t l_t and per-token statistics
    masked_policy_loss       (B, T) log-probs and mask -> per-sequence sums for every loss_agg mode

``chunk_tokens_for`` sizes their chunks: how many tokens' (tokens x vocabulary) working set fits a
byte budget.

The log-prob operations take the sampler's ``truncation`` (top-k, top-p: grpo_ds.algo.truncation):
the log-probs, the entropy and their gradients are then those of the distribution the sampler drew
from, each position's set found without sorting the vocabulary (``support``).

``backend`` is "triton" or "torch" (resolve "auto" with grpo_ds.config.software.resolve_backend
first). Triton modules are imported only when the Triton backend is used, so the CPU path never
needs Triton. No kernel communicates: cross-rank sums belong to the driver.

Modules: this one (the operations above), the chunked PyTorch path (``chunked``), the sampler's set
of each position under truncated sampling (``support``), and the Triton kernels: group
advantages (``advantages``), log-probs and entropy from logits (``logprobs``), the same and the
policy loss from hidden states and the lm_head weight (``fused_linear``), the masked policy loss
(``policy_loss``), and the device functions they share (``token_math``). Rule
(tests/test_layout.py): imports nothing of grpo_ds but algo and kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_ds.algo.advantages import check_arguments
from grpo_ds.algo.advantages import group_advantages as reference_advantages
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation
from grpo_ds.kernels import chunked, support


class LossInputs(NamedTuple):
    """Per-token inputs of the policy loss, each (N,): the sampled token, its sequence's advantage,
    its weight w_t in the step loss (grpo_ds.algo.aggregation; 0 for padding), and optional old /
    reference log-probs (None: on-policy / no reference model)."""

    targets: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # () sum_t w_t l_t, differentiable
    logprobs: torch.Tensor  # (N,) float32, detached
    entropy: torch.Tensor  # (N,)
    kl: torch.Tensor  # (N,)
    clipped: torch.Tensor  # (N,) 1.0 where a clip changed the loss


class SequenceSums(NamedTuple):
    """Per-sequence sums over masked-in tokens, each (B,) float32; only ``loss`` is
    differentiable."""

    loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped: torch.Tensor
    tokens: torch.Tensor


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    baseline: str = "group_mean",
    scale: str = "group",
    eps: float = 1e-6,
    backend: str = "torch",
) -> torch.Tensor:
    """Advantages (P*G,) float32; see grpo_ds.algo.advantages for the formulas."""
    if backend == "torch":
        return reference_advantages(rewards, group_size, baseline, scale, eps)
    from grpo_ds.kernels import advantages as triton_advantages

    check_arguments(rewards, group_size, baseline, scale)
    return triton_advantages.group_advantages(rewards, group_size, baseline, scale, eps)


def chunk_bytes_per_token(vocab: int, dtype: torch.dtype, backend: str) -> int:
    """Bytes one token adds to a chunk's working set: its row of logits in ``dtype``, which the
    Triton kernels overwrite in place with its gradient; the PyTorch path adds float32 rows of the
    scaled logits (float32 logits are their own) and of the probabilities
    (grpo_ds.kernels.chunked)."""
    itemsize = torch.finfo(dtype).bits // 8
    if backend == "triton":
        return vocab * itemsize
    return vocab * (8 if dtype == torch.float32 else itemsize + 8)


def chunk_tokens_for(vocab: int, dtype: torch.dtype, backend: str, budget_bytes: int) -> int:
    """The most tokens per chunk whose working set (``chunk_bytes_per_token``) stays within
    ``budget_bytes``; at least 1, even where one token's row is larger than the budget."""
    return max(1, budget_bytes // chunk_bytes_per_token(vocab, dtype, backend))


def logprob_chunk_tokens(
    vocab: int, dtype: torch.dtype, backend: str, budget_mib: float, override_tokens: int | None
) -> int:
    """Tokens per chunk of the log-prob kernels: ``override_tokens`` (kernels.logprob_chunk_tokens)
    when set, else as many as ``budget_mib`` (kernels.logprob_chunk_mib) holds
    (``chunk_tokens_for``)."""
    if override_tokens is not None:
        return override_tokens
    return chunk_tokens_for(vocab, dtype, backend, int(budget_mib * 2**20))


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    backend: str = "torch",
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob (N,), entropy (N,)) float32 of softmax(logits[rows] / temperature) at ``targets``,
    over each row's sampler set under ``truncation``.

    ``logits`` (M, V) in any float dtype; ``rows`` (N,) distinct row indices (None: all M rows, N =
    M). Differentiable w.r.t. the logits; rows that are not scored get gradient 0.
    """
    _check_common(logits, targets, temperature, chunk_tokens)
    all_rows = rows is None
    rows = (
        torch.arange(logits.shape[0], device=logits.device)
        if all_rows
        else rows.to(logits.device).long()
    )
    if rows.shape != targets.shape:
        raise ValueError(
            f"rows {tuple(rows.shape)} and targets {tuple(targets.shape)} must both be (N,)"
        )
    if backend == "torch":  # all rows: chunks are views, no gathers
        return chunked.LogprobsFromLogits.apply(
            logits, None if all_rows else rows, targets, temperature, chunk_tokens, truncation
        )
    from grpo_ds.kernels import logprobs as triton_logprobs

    if rows.numel() != torch.unique(rows).numel():
        raise ValueError("rows must be distinct (each logits row is scored at most once)")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    with torch.no_grad():  # constants of the gradient, a chunk of rows at a time
        chunks = [
            support.find_if_cut(logits[rows[a : a + chunk_tokens]], temperature, truncation)
            for a in range(0, rows.numel(), chunk_tokens)
        ]
    thresholds = (
        torch.cat([c.thresholds for c in chunks]) if chunks and chunks[0] is not None else None
    )
    return triton_logprobs.LogprobsFromLogits.apply(
        logits, rows.contiguous(), targets.contiguous(), temperature, thresholds
    )


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    backend: str = "torch",
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob (N,), entropy (N,)) float32 of softmax(hidden @ weight.T / temperature) at
    ``targets``, over each position's sampler set under ``truncation``.

    hidden (N, H), weight (V, H) (the lm_head). Differentiable w.r.t. both; logits exist one chunk
    at a time.
    """
    _check_hidden(hidden, weight, targets, temperature, chunk_tokens)
    if backend == "torch":
        return chunked.LogprobsFromHidden.apply(
            hidden, weight, targets, temperature, chunk_tokens, truncation
        )
    from grpo_ds.kernels import fused_linear

    return fused_linear.LogprobsFromHidden.apply(
        hidden.contiguous(), weight, targets.contiguous(), temperature, chunk_tokens, truncation
    )


def policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    inputs: LossInputs,
    cfg: LossConfig,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    backend: str = "torch",
    truncation: Truncation = NO_TRUNCATION,
) -> PolicyLossOutput:
    """The step-loss contribution sum_t w_t l_t of N tokens, from hidden states and the lm_head
    weight; log-probs and entropy over each position's sampler set under ``truncation``.

    Token-level losses only (``cfg.policy_loss`` "ppo_clip"); GSPO's sequence ratio needs every
    token of a sequence first: use ``logprobs_from_hidden`` and
    grpo_ds.algo.policy_loss.token_losses for it.
    """
    _check_token_level(cfg)
    _check_hidden(hidden, weight, inputs.targets, temperature, chunk_tokens)
    for name, value in zip(LossInputs._fields[1:], inputs[1:], strict=True):
        if value is not None and value.shape != inputs.targets.shape:
            raise ValueError(
                f"{name} must be (N,) = {tuple(inputs.targets.shape)}, got {tuple(value.shape)}"
            )
    # no backward can follow: both paths then skip the gradients they would compute
    if not torch.is_grad_enabled():
        # in the forward (autograd still flags inputs under no_grad)
        hidden, weight = hidden.detach(), weight.detach()
    if backend == "torch":
        function = chunked.PolicyLossFromHidden
    else:
        from grpo_ds.kernels import fused_linear

        function = fused_linear.PolicyLossFromHidden
    loss, stats = function.apply(
        hidden.contiguous(),
        weight,
        inputs.targets.contiguous(),
        inputs.old_logprobs,
        inputs.ref_logprobs,
        inputs.advantages,
        inputs.token_weights,
        cfg,
        temperature,
        chunk_tokens,
        truncation,
    )
    return PolicyLossOutput(loss, stats[0], stats[1], stats[2], stats[3])


def masked_policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    backend: str = "torch",
) -> SequenceSums:
    """Per-sequence sums over a (B, T) batch; advantages (B,).

    ``mask`` (B, T) holds a weight m_t >= 0 per token (0 = masked out): ``loss`` is sum_t m_t l_t,
    the other sums are plain sums over the tokens with m_t != 0.
    """
    _check_token_level(cfg)
    _check_masked_shapes(logprobs, advantages, mask, old_logprobs, ref_logprobs, entropy)
    if backend == "torch":
        return _masked_policy_loss_torch(
            logprobs, advantages, mask, cfg, old_logprobs, ref_logprobs, entropy
        )
    from grpo_ds.kernels import policy_loss as triton_policy_loss

    sums = triton_policy_loss.MaskedPolicyLoss.apply(
        logprobs, old_logprobs, ref_logprobs, entropy, advantages, mask, cfg
    )
    return SequenceSums(
        sums[0], sums[1].detach(), sums[2].detach(), sums[3].detach(), sums[4].detach()
    )


def _check_masked_shapes(logprobs, advantages, mask, old_logprobs, ref_logprobs, entropy) -> None:
    """masked_policy_loss's operands: (B, T) tokens and (B,) advantages, or a ValueError."""
    if (
        logprobs.dim() != 2
        or mask.shape != logprobs.shape
        or advantages.shape != logprobs.shape[:1]
    ):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} must be (B, T) and "
            f"advantages {tuple(advantages.shape)} must be (B,)"
        )
    for name, value in (
        ("old_logprobs", old_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
    ):
        if value is not None and value.shape != logprobs.shape:
            raise ValueError(
                f"{name} must be (B, T) = {tuple(logprobs.shape)}, got {tuple(value.shape)}"
            )


def _masked_policy_loss_torch(
    logprobs, advantages, mask, cfg, old_logprobs, ref_logprobs, entropy
) -> SequenceSums:
    """masked_policy_loss through the reference token losses (grpo_ds.algo.policy_loss)."""
    keep = mask != 0  # (B, T)

    # masked-out inf/NaN must not reach autograd
    def kept(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else torch.where(keep, values, torch.zeros_like(values))

    per_token, kl, clipped = token_losses(
        kept(logprobs),
        kept(old_logprobs),
        advantages.float()[:, None].expand_as(logprobs),
        kept(ref_logprobs),
        kept(entropy),
        cfg,
    )
    ent = kept(entropy).detach() if entropy is not None else torch.zeros_like(per_token)

    def row_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, values.float(), 0.0).sum(dim=1)  # (B,)

    return SequenceSums(
        row_sum(per_token * mask),
        row_sum(kl.detach()),
        row_sum(ent),
        row_sum(clipped),
        keep.sum(dim=1).float(),
    )


def _check_token_level(cfg: LossConfig) -> None:
    if cfg.policy_loss != "ppo_clip":
        raise ValueError(
            f"the fused policy-loss kernels compute token-level losses (ppo_clip), not "
            f"{cfg.policy_loss!r}; compute log-probs with the kernels and the loss with "
            "grpo_ds.algo.policy_loss.token_losses"
        )


def _check_common(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (M, V), got shape {tuple(logits.shape)}")
    if targets.dim() != 1:
        raise ValueError(f"targets must be (N,), got shape {tuple(targets.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be (N,) = ({hidden.shape[0]},), got {tuple(targets.shape)}")
    _check_common(hidden, targets, temperature, chunk_tokens)
