"""The PyTorch path of the log-prob kernels: the same row formulas, chunk by chunk, in plain PyTorch.

Used on CPU, and wherever kernels.backend is "torch". With s = logits / temperature for one chunk of rows,
p = softmax(s) and E = sum_v p_v s_v (grpo_ds.kernels.token_math states the formulas):

    logprob = s_y - lse(s),  entropy = lse(s) - E
    d/ds (g_lp * logprob + g_ent * entropy) = g_lp * (onehot_y - p) - g_ent * p * (s - E)

Memory stays bounded by the chunk: the forward keeps 3 floats per token; the backward recomputes one chunk
at a time and writes its gradient straight into the preallocated gradient (in place where the chunk is a
scratch copy), so at most about two float32 chunks of (chunk_tokens x vocab) exist besides the gradient
itself. The fused-linear variant computes logits_c = hidden_c @ weight.T per chunk, so full logits never exist,
and accumulates the weight gradient in place. The reference these are tested against is grpo_ds/algo.
"""

from __future__ import annotations

import torch


def _spans(n: int, chunk_tokens: int):
    return [(a, min(a + chunk_tokens, n)) for a in range(0, n, chunk_tokens)]


def _zero_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if grad is None else grad.float()


class _Scratch:
    """The float32 chunk-sized buffers of one call, allocated once and reused by every chunk: a new (chunk, V) tensor
    per chunk would leave holes in the C allocator's heap that small tensors split, so the heap grows chunk after chunk
    (grpo_ds/run/host_allocator.py's module docstring tells the allocator's side of it)."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.s = torch.empty(rows, vocab, dtype=torch.float32, device=device)  # the scaled logits
        self.p = torch.empty(rows, vocab, dtype=torch.float32, device=device)  # the probabilities
        self.product = torch.empty(min(rows, _ROWS_AT_ONCE), vocab, dtype=torch.float32, device=device)


def _scaled(x: torch.Tensor, temperature: float, scratch: bool, into: torch.Tensor | None = None) -> torch.Tensor:
    """s = x / temperature in float32; reuses x's storage only when x is a scratch copy we own, else writes into
    ``into`` (c, V) when given."""
    if x.dtype != torch.float32 and into is not None:
        s = into.copy_(x)
    else:
        s = x.float()
    if temperature != 1.0:
        s = s.div_(temperature) if (scratch or s is not x) else s / temperature
    return s  # (c, V)


def _probabilities(s: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(p = softmax(s) (c, V), a new tensor or ``out``, lse (c,)) of float32 rows s."""
    m = s.amax(dim=1, keepdim=True)  # (c, 1)
    p = torch.sub(s, m, out=out).exp_()  # (c, V), the one chunk-sized temporary
    d = p.sum(dim=1, keepdim=True)  # (c, 1)
    p.div_(d)
    return p, (m + d.log()).squeeze(1)


def _row_stats(s: torch.Tensor, targets: torch.Tensor, scratch: _Scratch | None = None):
    """(p (c, V) a new tensor or scratch.p, lse (c,), mean_s (c,), logprob (c,)) of float32 rows s."""
    c = s.shape[0]
    p, lse = _probabilities(s, None if scratch is None else scratch.p[:c])
    mean_s = _row_dot(p, s, None if scratch is None else scratch.product)  # (c,) sum_v p_v s_v
    logprob = s.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    return p, lse, mean_s, logprob


_ROWS_AT_ONCE = 32


def _row_dot(p: torch.Tensor, s: torch.Tensor, product: torch.Tensor | None = None) -> torch.Tensor:
    """sum_v p_v s_v per row, a few rows at a time: torch's reductions sum pairwise (bmm on CPU accumulates
    sequentially, ~1e-3 off at 32k vocabulary), and the product temporary (``product`` when given) stays a small
    slice of the chunk."""
    k = _ROWS_AT_ONCE
    return torch.cat([torch.mul(p[i:i + k], s[i:i + k], out=None if product is None else product[:p[i:i + k].shape[0]])
                      .sum(dim=1) for i in range(0, p.shape[0], k)]) if p.shape[0] else p.new_zeros(0)


def _write_grad(s: torch.Tensor, p: torch.Tensor, targets: torch.Tensor, mean_s: torch.Tensor, g_logprob, g_entropy,
                temperature: float, out: torch.Tensor) -> None:
    """out = d/dx of sum(g_logprob * logprob + g_entropy * entropy) for x = s * temperature; float32 ``out`` may be
    ``s`` itself. Consumes ``p``."""
    torch.sub(s, mean_s.unsqueeze(1), out=out)
    out.mul_(p).mul_(-g_entropy.unsqueeze(1))
    out.sub_(p.mul_(g_logprob.unsqueeze(1)))
    out.scatter_add_(1, targets.unsqueeze(1), g_logprob.unsqueeze(1))
    if temperature != 1.0:
        out.div_(temperature)


def _chunk(logits: torch.Tensor, rows: torch.Tensor | None, a: int, b: int) -> tuple[torch.Tensor, bool]:
    """The chunk's logits rows and whether that is a scratch copy (a gather) rather than a view."""
    if rows is None:
        return logits[a:b], False
    return logits.index_select(0, rows[a:b]), True


class LogprobsFromLogits(torch.autograd.Function):
    """(logits (M, V), rows (N,) distinct or None for all, targets (N,), temperature, chunk_tokens)
    -> (logprob, entropy), each (N,) float32."""

    @staticmethod
    def forward(ctx, logits, rows, targets, temperature, chunk_tokens):
        n = targets.shape[0]
        out = torch.empty(3, n, dtype=torch.float32, device=logits.device)  # logprob, entropy, mean_s
        for a, b in _spans(n, chunk_tokens):
            x, scratch = _chunk(logits, rows, a, b)
            s = _scaled(x, temperature, scratch)
            p, lse, mean_s, logprob = _row_stats(s, targets[a:b])
            del p, s, x
            out[0, a:b], out[1, a:b], out[2, a:b] = logprob, lse - mean_s, mean_s
        ctx.save_for_backward(logits, rows, targets, out[2])
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        logits, rows, targets, mean_s = ctx.saved_tensors
        g_logprob, g_entropy = _zero_if_none(g_logprob, targets), _zero_if_none(g_entropy, targets)
        # Rows that are not scored get exactly zero gradient.
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)  # (M, V), logits dtype
        for a, b in _spans(targets.shape[0], ctx.chunk_tokens):
            x, scratch = _chunk(logits, rows, a, b)
            s = _scaled(x, ctx.temperature, scratch)
            p, _ = _probabilities(s)  # the backward reuses the forward's mean_s
            own = s is not x or scratch  # s is a float32 scratch copy: write the gradient into it
            target = grad[a:b] if rows is None and grad.dtype == torch.float32 and not own else s if own else \
                torch.empty_like(s)
            _write_grad(s, p, targets[a:b], mean_s[a:b], g_logprob[a:b], g_entropy[a:b], ctx.temperature, target)
            if rows is None:
                if target is not grad[a:b]:
                    grad[a:b].copy_(target)
            else:
                grad.index_copy_(0, rows[a:b], target.to(grad.dtype))
            del x, s, p, target  # free this chunk before the next one is allocated
        return grad, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """hidden_c @ weight.T (c, V), into the scratch's float32 buffer when the model is float32."""
    if hidden.dtype == torch.float32:
        return torch.matmul(hidden, weight.t(), out=scratch.s[:hidden.shape[0]])
    return hidden @ weight.t()


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,), temperature, chunk_tokens) -> (logprob, entropy) (N,) fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens):
        n = hidden.shape[0]
        out = torch.empty(3, n, dtype=torch.float32, device=hidden.device)  # logprob, entropy, mean_s
        scratch = _Scratch(min(n, chunk_tokens), weight.shape[0], hidden.device)
        for a, b in _spans(n, chunk_tokens):
            s = _scaled(_logits(hidden[a:b], weight, scratch), temperature, True, scratch.s[:b - a])  # (c, V), our own
            p, lse, mean_s, logprob = _row_stats(s, targets[a:b], scratch)
            del p, s
            out[0, a:b], out[1, a:b], out[2, a:b] = logprob, lse - mean_s, mean_s
        ctx.save_for_backward(hidden, weight, targets, out[2])
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets, mean_s = ctx.saved_tensors
        g_logprob, g_entropy = _zero_if_none(g_logprob, targets), _zero_if_none(g_entropy, targets)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, H)
        scratch = _Scratch(min(hidden.shape[0], ctx.chunk_tokens), weight.shape[0], hidden.device)
        for a, b in _spans(hidden.shape[0], ctx.chunk_tokens):
            s = _scaled(_logits(hidden[a:b], weight, scratch), ctx.temperature, True, scratch.s[:b - a])  # recomputed
            p, _ = _probabilities(s, scratch.p[:b - a])  # the backward reuses the forward's mean_s
            _write_grad(s, p, targets[a:b], mean_s[a:b], g_logprob[a:b], g_entropy[a:b], ctx.temperature, s)
            del p
            g = s.to(hidden.dtype)  # d/d logits_c
            grad_hidden[a:b] = g @ weight
            grad_weight.addmm_(g.t().float() if g.dtype != torch.float32 else g.t(), hidden[a:b].float())
            del s, g
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None
