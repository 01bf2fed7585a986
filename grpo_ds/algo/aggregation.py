"""Loss aggregation: how per-token losses become the one loss of an optimizer step.

One optimizer step sees a global mini-batch of sequences i (over all ranks and micro-batches) with
per-token losses l_it over the L_i response tokens of sequence i. With N the number of sequences
that have at least one response token and T = sum_i L_i:

    token-mean               loss = sum_it l_it / T
    seq-mean-token-mean      loss = (1/N) sum_i (1/L_i) sum_t l_it
    seq-mean-token-sum       loss = (1/N) sum_i sum_t l_it
    seq-mean-token-sum-norm  loss = (1/N) sum_i sum_t l_it / C    (Dr. GRPO, Liu et al. 2025,
                                                                   arXiv:2503.20783; C a constant,
                                                                   by default max_new_tokens)

Every mode is linear in the per-sequence sums: loss = sum_i w_i * sum_t l_it, and
``sequence_weights`` is the single place that computes w_i. The denominators (T, N, L_i, C) are
taken from the lengths of the WHOLE global mini-batch, never from one rank's shard or one
micro-batch: then any split of the sequences into ranks and micro-batches contributes partial sums
sum_{i in part} w_i sum_t l_it that add up to exactly the same loss (and gradient), so the result
does not depend on world size, micro-batch size or padding. A local mean (dividing by a
micro-batch's own token count) would instead weight tokens by the size of the micro-batch they
happened to land in.

Sequences with L_i = 0 (empty responses, padding rows) get w_i = 0 and are not counted in N, so
adding padding rows never changes the loss.
"""

from __future__ import annotations

import torch

from grpo_ds.algo.names import LOSS_AGG_MODES


def sequence_weights(
    response_lengths: list[int] | torch.Tensor, mode: str, norm_tokens: int
) -> torch.Tensor:
    """Return w (N,) float64 such that the step loss is sum_i w_i * sum_t l_it.

    ``response_lengths`` holds L_i for every sequence of the global mini-batch. ``norm_tokens`` is
    the constant C of seq-mean-token-sum-norm (ignored by the other modes).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}"
        )
    lengths = torch.as_tensor(response_lengths).to(torch.float64)  # (N,)
    if lengths.dim() != 1:
        raise ValueError(f"response_lengths must be 1-D (N,), got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError(f"response_lengths must be >= 0, got {lengths.tolist()}")
    has_tokens = lengths > 0  # (N,)
    num_seqs = int(has_tokens.sum())  # N: sequences with at least one response token
    zeros = torch.zeros_like(lengths)  # (N,)
    if num_seqs == 0:
        return zeros
    if mode == "token-mean":
        return torch.where(has_tokens, 1.0 / lengths.sum(), zeros)
    if mode == "seq-mean-token-mean":
        return torch.where(has_tokens, 1.0 / (num_seqs * lengths.clamp(min=1)), zeros)
    if mode == "seq-mean-token-sum":
        return torch.where(has_tokens, torch.full_like(lengths, 1.0 / num_seqs), zeros)
    if norm_tokens < 1:
        raise ValueError(
            "norm_tokens (the constant C of seq-mean-token-sum-norm) "
            f"must be >= 1, got {norm_tokens}"
        )
    return torch.where(has_tokens, torch.full_like(lengths, 1.0 / (num_seqs * norm_tokens)), zeros)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm_tokens: int
) -> torch.Tensor:
    """Aggregate per-token losses (N, T) over the response tokens marked 1 in ``mask`` (N, T) into a
    scalar.

    This treats the (N, T) batch as the whole global mini-batch. Masked-out positions are ignored
    even if they hold inf or NaN. The result is float32 (float64 if ``per_token`` is float64).
    """
    if per_token.dim() != 2 or per_token.shape != mask.shape:
        raise ValueError(
            f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must both be (N, T)"
        )
    keep = mask.bool()  # (N, T)
    weights = sequence_weights(keep.sum(dim=-1), mode, norm_tokens)  # (N,) float64
    dtype = torch.promote_types(per_token.dtype, torch.float32)
    seq_sums = torch.where(keep, per_token.to(dtype), 0.0).sum(dim=-1)  # (N,)
    return (weights.to(device=per_token.device, dtype=dtype) * seq_sums).sum()
