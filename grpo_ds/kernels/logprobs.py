"""Triton: per-token log-prob of the sampled token and entropy, from logits, forward and backward.

One program per token row reads the row in vocabulary blocks with an online log-sum-exp
(token_math), so no float32 copy of the (tokens x vocab) logits is ever made: the forward keeps 3
floats per token (log-prob, entropy, lse), the backward re-reads the row and writes the gradient in
the logits' dtype. ``rows`` selects which rows of a larger (M, V) logits matrix are scored (the
response positions of a padded batch) without gathering them into a copy. Under truncated sampling
each row comes with the threshold of the sampler's set (grpo_ds.kernels.support), one float per row,
and the sums run over that set. Reference: grpo_ds.algo.logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_ds.kernels.token_math import DEFAULT_LAUNCH, Launch, row_grad, row_logprob_entropy


@triton.jit
def _forward(
    logits_ptr,
    row_stride,
    rows_ptr,
    targets_ptr,
    thresholds_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    inv_temp,
    TRUNCATED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    target = tl.load(targets_ptr + i).to(tl.int64)
    threshold = tl.load(thresholds_ptr + i) if TRUNCATED else float("-inf")
    logprob, entropy, lse = row_logprob_entropy(
        logits_ptr + row * row_stride, target, V, inv_temp, threshold, TRUNCATED, BLOCK_V
    )
    tl.store(logprob_ptr + i, logprob)
    tl.store(entropy_ptr + i, entropy)
    tl.store(lse_ptr + i, lse)


@triton.jit
def _backward(
    logits_ptr,
    row_stride,
    rows_ptr,
    targets_ptr,
    thresholds_ptr,
    lse_ptr,
    entropy_ptr,
    g_logprob_ptr,
    g_entropy_ptr,
    grad_ptr,
    grad_row_stride,
    V,
    inv_temp,
    TRUNCATED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    threshold = tl.load(thresholds_ptr + i) if TRUNCATED else float("-inf")
    row_grad(
        logits_ptr + row * row_stride,
        grad_ptr + row * grad_row_stride,
        tl.load(targets_ptr + i).to(tl.int64),
        V,
        inv_temp,
        tl.load(lse_ptr + i),
        tl.load(entropy_ptr + i),
        tl.load(g_logprob_ptr + i),
        tl.load(g_entropy_ptr + i),
        threshold,
        TRUNCATED,
        BLOCK_V,
    )


def rows_forward(
    logits: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    launch: Launch = DEFAULT_LAUNCH,
    thresholds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, lse), each (N,) float32, of ``logits[rows]`` (logits (M, V), rows
    contiguous); over each row's sampler set where ``thresholds`` (N,) float32 in logit units is
    given (grpo_ds.kernels.support)."""
    n, vocab = rows.numel(), logits.shape[1]
    out = torch.empty(3, n, dtype=torch.float32, device=logits.device)  # (3, N)
    if n:
        _forward[(n,)](
            logits,
            logits.stride(0),
            rows,
            targets,
            out[0] if thresholds is None else thresholds,
            out[0],
            out[1],
            out[2],
            vocab,
            1.0 / temperature,
            TRUNCATED=thresholds is not None,
            **launch.options(vocab),
        )
    return out[0], out[1], out[2]


def rows_backward(
    logits: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
    grad: torch.Tensor,
    launch: Launch = DEFAULT_LAUNCH,
    thresholds: torch.Tensor | None = None,
) -> None:
    """Write the gradient of ``logits[rows]`` into ``grad[rows]`` (same shape as logits, last dim
    contiguous; may alias). The row strides may differ: a column slice of wider logits gets a
    contiguous gradient. ``thresholds``: as for rows_forward."""
    n, vocab = rows.numel(), logits.shape[1]
    if n:
        _backward[(n,)](
            logits,
            logits.stride(0),
            rows,
            targets,
            lse if thresholds is None else thresholds,
            lse,
            entropy,
            g_logprob.contiguous(),
            g_entropy.contiguous(),
            grad,
            grad.stride(0),
            vocab,
            1.0 / temperature,
            TRUNCATED=thresholds is not None,
            **launch.options(vocab),
        )


class LogprobsFromLogits(torch.autograd.Function):
    """(logits (M, V), rows (N,), targets (N,), temperature, thresholds (N,) or None) -> (logprob
    (N,), entropy (N,)) float32."""

    @staticmethod
    def forward(ctx, logits, rows, targets, temperature, thresholds):
        logprob, entropy, lse = rows_forward(
            logits, rows, targets, temperature, thresholds=thresholds
        )
        ctx.save_for_backward(logits, rows, targets, lse, entropy, thresholds)
        ctx.temperature = temperature
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        logits, rows, targets, lse, entropy, thresholds = ctx.saved_tensors
        g_logprob = torch.zeros_like(lse) if g_logprob is None else g_logprob.float()
        g_entropy = torch.zeros_like(lse) if g_entropy is None else g_entropy.float()
        # Rows that are not scored get exactly zero gradient; skip the zero fill when every row is
        # scored.
        covers_all = rows.numel() == logits.shape[0]
        # (M, V), logits dtype
        grad = torch.empty_like(logits) if covers_all else torch.zeros_like(logits)
        rows_backward(
            logits,
            rows,
            targets,
            ctx.temperature,
            lse,
            entropy,
            g_logprob,
            g_entropy,
            grad,
            thresholds=thresholds,
        )
        return grad, None, None, None, None
