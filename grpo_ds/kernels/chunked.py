"""The PyTorch path of every kernel: the reference math of grpo_ds/algo, run chunk by chunk.

Used on CPU, and wherever kernels.backend is "torch". Memory stays bounded by the chunk: the forward keeps
no (tokens x vocab) temporaries, and the backward recomputes one chunk at a time with autograd on the
reference formula, writing each chunk's gradient into one preallocated gradient tensor (plain activation
checkpointing would instead keep every chunk's gradient alive until they are concatenated). The
fused-linear variant computes logits_c = hidden_c @ weight.T per chunk, so full logits never exist.
"""

from __future__ import annotations

import torch

from grpo_ds.algo.logprobs import rows_logprobs_and_entropy


def _spans(n: int, chunk_tokens: int):
    return [(a, min(a + chunk_tokens, n)) for a in range(0, n, chunk_tokens)]


def _zero_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.float32) if grad is None else grad


class LogprobsFromLogits(torch.autograd.Function):
    """(logits (M, V), rows (N,) distinct, targets (N,), temperature, chunk_tokens) -> (logprob, entropy) (N,)."""

    @staticmethod
    def forward(ctx, logits, rows, targets, temperature, chunk_tokens):
        pieces = [rows_logprobs_and_entropy(logits[rows[a:b]], targets[a:b], temperature)
                  for a, b in _spans(rows.numel(), chunk_tokens)]
        ctx.save_for_backward(logits, rows, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        if not pieces:
            empty = logits.new_zeros(0, dtype=torch.float32)
            return empty, empty.clone()
        return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        logits, rows, targets = ctx.saved_tensors
        g_logprob, g_entropy = _zero_if_none(g_logprob, rows), _zero_if_none(g_entropy, rows)
        grad = torch.zeros_like(logits)  # (M, V): rows that are not scored get exactly 0
        for a, b in _spans(rows.numel(), ctx.chunk_tokens):
            chunk = logits[rows[a:b]].detach().requires_grad_(True)  # (c, V) copy of one chunk
            with torch.enable_grad():
                lp, ent = rows_logprobs_and_entropy(chunk, targets[a:b], ctx.temperature)
                torch.autograd.backward((lp, ent), (g_logprob[a:b], g_entropy[a:b]))
            grad.index_copy_(0, rows[a:b], chunk.grad)
        return grad, None, None, None, None


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,), temperature, chunk_tokens) -> (logprob, entropy) (N,) fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens):
        pieces = [rows_logprobs_and_entropy(hidden[a:b] @ weight.t(), targets[a:b], temperature)
                  for a, b in _spans(hidden.shape[0], chunk_tokens)]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        if not pieces:
            empty = hidden.new_zeros(0, dtype=torch.float32)
            return empty, empty.clone()
        return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets = ctx.saved_tensors
        g_logprob, g_entropy = _zero_if_none(g_logprob, targets), _zero_if_none(g_entropy, targets)
        grad_hidden = torch.zeros_like(hidden)
        weight_leaf = weight.detach().requires_grad_(True)  # autograd sums the chunks' gradients in .grad
        for a, b in _spans(hidden.shape[0], ctx.chunk_tokens):
            hidden_chunk = hidden[a:b].detach().requires_grad_(True)
            with torch.enable_grad():
                lp, ent = rows_logprobs_and_entropy(hidden_chunk @ weight_leaf.t(), targets[a:b], ctx.temperature)
                torch.autograd.backward((lp, ent), (g_logprob[a:b], g_entropy[a:b]))
            grad_hidden[a:b] = hidden_chunk.grad
        grad_weight = weight_leaf.grad if weight_leaf.grad is not None else torch.zeros_like(weight)
        return grad_hidden, grad_weight, None, None, None
