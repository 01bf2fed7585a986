"""Per-token log-probabilities and entropies from logits, chunked over tokens.

With s = logits / temperature (one row per token position) and target token y:

    logprob = s_y - logsumexp(s)
    entropy = -sum_v p_v log p_v = logsumexp(s) - sum_v p_v s_v,     p = softmax(s)

Under truncated sampling (top-k, top-p: grpo_ds.algo.truncation) the sums run over the sampler's set
S of each position instead of the whole vocabulary: logsumexp and p over S, p_v = 0 outside it, so
that the log-prob is the one the sampler recorded for the same weights.

Logits usually arrive in bf16; the math runs in float32. Rows are processed ``chunk_tokens`` at a
time so the float32 copy of the (N, V) logits never exists at once: each chunk is wrapped in
activation checkpointing, so the backward pass recomputes one chunk's float32 temporaries at a time
instead of keeping every chunk's alive until backward. The gradient w.r.t. the logits is exact
(plain autograd per chunk).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation, support_mask


def rows_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float,
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula on one chunk of rows: (logprobs (n,), entropy (n,)) float32; makes float32 (n, V)
    temporaries."""
    scaled = logits.to(torch.float32) / temperature  # (n, V)
    # (n, V) S; a constant of the gradient
    keep = support_mask(logits, target_ids, temperature, truncation)
    lse = torch.logsumexp(scaled.masked_fill(~keep, float("-inf")), dim=-1)  # (n,)
    logprobs = scaled.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - lse  # (n,)
    probs = torch.exp(scaled - lse.unsqueeze(-1)).masked_fill(~keep, 0.0)  # (n, V), 0 outside S
    entropy = lse - (probs * scaled).sum(dim=-1)  # (n,)
    return logprobs, entropy


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprobs (N,), entropy (N,)), both float32, of softmax(logits / temperature) over
    each position's sampling set under ``truncation`` (the whole vocabulary without one).

    ``logits`` is (N, V) in any float dtype, ``target_ids`` is (N,) int64. Differentiable w.r.t.
    ``logits``; the gradient has the logits' dtype.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    if target_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"target_ids must be (N,) = ({logits.shape[0]},), got shape {tuple(target_ids.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[0] == 0:
        empty = logits.new_zeros(0, dtype=torch.float32)  # (0,)
        return empty, empty.clone()
    # Recompute in backward only when a backward can happen; under no_grad plain chunking suffices.
    recompute = torch.is_grad_enabled() and logits.requires_grad
    logprob_chunks, entropy_chunks = [], []
    # torch.split (not slicing in a loop) gives one SplitBackward node, so the gradient is assembled
    # with a single concatenation rather than one full-size zero tensor per chunk.
    for logit_chunk, target_chunk in zip(
        logits.split(chunk_tokens), target_ids.split(chunk_tokens), strict=True
    ):
        if recompute:
            lp, ent = checkpoint(
                rows_logprobs_and_entropy,
                logit_chunk,
                target_chunk,
                temperature,
                truncation,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        else:
            lp, ent = rows_logprobs_and_entropy(logit_chunk, target_chunk, temperature, truncation)
        logprob_chunks.append(lp)
        entropy_chunks.append(ent)
    return torch.cat(logprob_chunks), torch.cat(entropy_chunks)  # (N,), (N,)
