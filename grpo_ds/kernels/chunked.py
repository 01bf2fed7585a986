"""The PyTorch path of the log-prob kernels: the same row formulas, chunk by chunk, in plain
PyTorch.

Used on CPU, and wherever kernels.backend is "torch". With s = logits / temperature for one chunk of
rows, p = softmax(s) and E = sum_v p_v s_v (grpo_ds.kernels.token_math states the formulas):

    logprob = s_y - lse(s),  entropy = lse(s) - E
    d/ds (g_lp * logprob + g_ent * entropy) = g_lp * (onehot_y - p) - g_ent * p * (s - E)

Memory stays bounded by the chunk: the forward keeps 3 floats per token; the backward recomputes one
chunk at a time and writes its gradient straight into the preallocated gradient (in place where the
chunk is a scratch copy), so at most about two float32 chunks of (chunk_tokens x vocab) exist
besides the gradient itself. The fused-linear variants compute logits_c = hidden_c @ weight.T per
chunk, so full logits never exist, and accumulate the weight gradient in place; their chunk buffers
are allocated once per call. PolicyLossFromHidden computes the gradients in the forward, where the
loss is known, and so never recomputes a chunk. The reference these are tested against is
grpo_ds/algo.

Under truncated sampling (grpo_ds.algo.truncation) each chunk's rows get the sampler's set from
their logits (grpo_ds.kernels.support). Where every row's set lies among a few candidates (top-k, or
top-p decided by its first 1,024 tokens), a forward takes the log-prob and the entropy from those
candidates alone, with no pass over the vocabulary. Otherwise, and in every backward, the logits
below the row's threshold, the sampled token's excepted, are set to ``_OUTSIDE`` in the chunk's own
float32 copy before the temperature: p is then exactly 0 there, and so is the gradient, with the
formulas above unchanged. The thresholds (one float per token) are kept for the backward.
"""

from __future__ import annotations

import torch

from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation
from grpo_ds.kernels import support

# The score of a token outside the sampler's set: exp of it (less the row's maximum) is exactly 0,
# and 0 x it is 0, where -inf would give NaN in sum_v p_v s_v and in the gradient's p (s - E).
_OUTSIDE = -1e30


def _spans(n: int, chunk_tokens: int):
    return [(a, min(a + chunk_tokens, n)) for a in range(0, n, chunk_tokens)]


def _zero_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return (
        torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        if grad is None
        else grad.float()
    )


class _Scratch:
    """The float32 chunk-sized buffers of one call, allocated once and reused by every chunk: a new
    (chunk, V) tensor per chunk would leave holes in the C allocator's heap that small tensors
    split, so the heap grows chunk after chunk (grpo_ds/run/host_allocator.py's module docstring
    tells the allocator's side of it)."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.s = torch.empty(rows, vocab, dtype=torch.float32, device=device)  # the scaled logits
        self.p = torch.empty(rows, vocab, dtype=torch.float32, device=device)  # the probabilities
        self.product = torch.empty(
            min(rows, _ROWS_AT_ONCE), vocab, dtype=torch.float32, device=device
        )


def _scaled(
    x: torch.Tensor, temperature: float, scratch: bool, into: torch.Tensor | None = None
) -> torch.Tensor:
    """s = x / temperature in float32; reuses x's storage only when x is a scratch copy we own, else
    writes into ``into`` (c, V) when given."""
    if x.dtype != torch.float32 and into is not None:
        s = into.copy_(x)
    else:
        s = x.float()
    if temperature != 1.0:
        s = s.div_(temperature) if (scratch or s is not x) else s / temperature
    return s  # (c, V)


def _probabilities(
    s: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p = softmax(s) (c, V), a new tensor or ``out``, lse (c,)) of float32 rows s."""
    m = s.amax(dim=1, keepdim=True)  # (c, 1)
    p = torch.sub(s, m, out=out).exp_()  # (c, V), the one chunk-sized temporary
    d = p.sum(dim=1, keepdim=True)  # (c, 1)
    p.div_(d)
    return p, (m + d.log()).squeeze(1)


def _row_stats(s: torch.Tensor, targets: torch.Tensor, scratch: _Scratch | None = None):
    """(p (c, V) a new tensor or scratch.p, lse (c,), mean_s (c,), logprob (c,)) of float32 rows
    s."""
    c = s.shape[0]
    p, lse = _probabilities(s, None if scratch is None else scratch.p[:c])
    mean_s = _row_dot(p, s, None if scratch is None else scratch.product)  # (c,) sum_v p_v s_v
    logprob = s.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    return p, lse, mean_s, logprob


_ROWS_AT_ONCE = 32


def _row_dot(p: torch.Tensor, s: torch.Tensor, product: torch.Tensor | None = None) -> torch.Tensor:
    """sum_v p_v s_v per row, a few rows at a time: torch's reductions sum pairwise (bmm on CPU
    accumulates sequentially, ~1e-3 off at 32k vocabulary), and the product temporary (``product``
    when given) stays a small slice of the chunk."""
    k = _ROWS_AT_ONCE
    return (
        torch.cat(
            [
                torch.mul(
                    p[i : i + k],
                    s[i : i + k],
                    out=None if product is None else product[: p[i : i + k].shape[0]],
                ).sum(dim=1)
                for i in range(0, p.shape[0], k)
            ]
        )
        if p.shape[0]
        else p.new_zeros(0)
    )


def _write_grad(
    s: torch.Tensor,
    p: torch.Tensor,
    targets: torch.Tensor,
    mean_s: torch.Tensor,
    g_logprob,
    g_entropy,
    temperature: float,
    out: torch.Tensor,
) -> None:
    """out = d/dx of sum(g_logprob * logprob + g_entropy * entropy) for x = s * temperature; float32
    ``out`` may be ``s`` itself. Consumes ``p``."""
    torch.sub(s, mean_s.unsqueeze(1), out=out)
    out.mul_(p).mul_(-g_entropy.unsqueeze(1))
    out.sub_(p.mul_(g_logprob.unsqueeze(1)))
    out.scatter_add_(1, targets.unsqueeze(1), g_logprob.unsqueeze(1))
    if temperature != 1.0:
        out.div_(temperature)


def _truncate(raw: torch.Tensor, targets: torch.Tensor, thresholds: torch.Tensor) -> None:
    """Set the logits of ``raw`` (c, V), float32 and our own, below each row's threshold to
    _OUTSIDE, in place, except the sampled token's (``targets`` (c,)); a block of rows at a time
    (the comparison's mask is that big)."""
    picked = raw.gather(1, targets.unsqueeze(1))  # (c, 1)
    for i in range(0, raw.shape[0], _ROWS_AT_ONCE):
        block = raw[i : i + _ROWS_AT_ONCE]
        block.masked_fill_(block < thresholds[i : i + _ROWS_AT_ONCE, None], _OUTSIDE)
    raw.scatter_(1, targets.unsqueeze(1), picked)


def _scores(
    x: torch.Tensor,
    temperature: float,
    scratch: bool,
    targets: torch.Tensor,
    thresholds: torch.Tensor | None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """s = x / temperature in float32 (``_scaled``) over the sampler's set: where ``thresholds``
    (c,) are given, the logits below them are cut first, in logit units (as the Triton kernels
    compare), in a float32 copy of our own (``x`` itself when it is one: ``scratch`` and float32;
    else ``into`` when given)."""
    if thresholds is None:
        return _scaled(x, temperature, scratch, into)
    if scratch and x.dtype == torch.float32:
        raw = x
    elif into is not None:
        raw = into.copy_(x)
    else:
        raw = x.float() if x.dtype != torch.float32 else x.clone()
    _truncate(raw, targets, thresholds)
    return raw.div_(temperature) if temperature != 1.0 else raw


def _stats_in_sets(
    sets: support.RowSets, picked: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, mean_s), each (c,), of rows whose whole sets are among the candidates of
    ``sets``, from the candidates alone (no pass over the vocabulary); ``picked`` (c,): the sampled
    tokens' float32 logits. The sampled token, when outside the set, is one more term."""
    keep = ~(sets.values < sets.thresholds[:, None])  # (c, m) the set among the candidates
    outside = picked < sets.thresholds  # (c,) the sampled token is not among them
    s = torch.where(keep, sets.values / temperature, float("-inf"))  # (c, m)
    s_y = picked / temperature  # (c,)
    lse = torch.logaddexp(s.logsumexp(dim=1), torch.where(outside, s_y, float("-inf")))  # (c,)
    q = torch.exp(s - lse[:, None])  # (c, m), 0 outside the set
    mean_s = (q * torch.where(keep, s, 0.0)).sum(dim=1) + torch.where(
        outside, torch.exp(s_y - lse) * s_y, 0.0
    )
    return s_y - lse, lse - mean_s, mean_s


def _forward_chunk(
    x: torch.Tensor,
    scratch: bool,
    targets: torch.Tensor,
    temperature: float,
    truncation: Truncation,
    out: torch.Tensor,
    buffers: _Scratch | None = None,
) -> None:
    """One chunk's log-prob, entropy, mean_s and threshold (the forward's ``out`` (4, c)) from its
    logits ``x`` (c, V): from the candidates alone where every row's set lies among them (no pass
    over the vocabulary), else from the scaled scores over the set (in ``buffers``' float32 rows
    when given)."""
    sets = support.find_if_cut(x, temperature, truncation)
    if sets is not None and sets.values is not None:
        out[:3] = torch.stack(
            _stats_in_sets(sets, x.gather(1, targets[:, None]).squeeze(1).float(), temperature)
        )
    else:
        s = _scores(
            x,
            temperature,
            scratch,
            targets,
            None if sets is None else sets.thresholds,
            None if buffers is None else buffers.s[: x.shape[0]],
        )
        p, lse, mean_s, logprob = _row_stats(s, targets, buffers)
        out[0], out[1], out[2] = logprob, lse - mean_s, mean_s
    if sets is not None:
        out[3] = sets.thresholds


def _chunk(
    logits: torch.Tensor, rows: torch.Tensor | None, a: int, b: int
) -> tuple[torch.Tensor, bool]:
    """The chunk's logits rows and whether that is a scratch copy (a gather) rather than a view."""
    if rows is None:
        return logits[a:b], False
    return logits.index_select(0, rows[a:b]), True


class LogprobsFromLogits(torch.autograd.Function):
    """(logits (M, V), rows (N,) distinct or None for all, targets (N,), temperature, chunk_tokens,
    truncation) -> (logprob, entropy), each (N,) float32."""

    @staticmethod
    def forward(
        ctx,
        logits,
        rows,
        targets,
        temperature,
        chunk_tokens,
        truncation: Truncation = NO_TRUNCATION,
    ):
        n = targets.shape[0]
        # logprob, entropy, mean_s, threshold
        out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
        for a, b in _spans(n, chunk_tokens):
            x, scratch = _chunk(logits, rows, a, b)
            _forward_chunk(x, scratch, targets[a:b], temperature, truncation, out[:, a:b])
            del x
        ctx.save_for_backward(logits, rows, targets, out[2], out[3])
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.truncated = truncation.cuts(logits.shape[1])
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        logits, rows, targets, mean_s, thresholds = ctx.saved_tensors
        g_logprob, g_entropy = _zero_if_none(g_logprob, targets), _zero_if_none(g_entropy, targets)
        # Rows that are not scored get exactly zero gradient.
        # (M, V), logits dtype
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)
        for a, b in _spans(targets.shape[0], ctx.chunk_tokens):
            x, scratch = _chunk(logits, rows, a, b)
            s = _scores(
                x,
                ctx.temperature,
                scratch,
                targets[a:b],
                thresholds[a:b] if ctx.truncated else None,
            )
            p, _ = _probabilities(s)  # the backward reuses the forward's mean_s
            own = s is not x or scratch  # s is a float32 scratch copy: write the gradient into it
            target = (
                grad[a:b]
                if rows is None and grad.dtype == torch.float32 and not own
                else s
                if own
                else torch.empty_like(s)
            )
            _write_grad(
                s,
                p,
                targets[a:b],
                mean_s[a:b],
                g_logprob[a:b],
                g_entropy[a:b],
                ctx.temperature,
                target,
            )
            if rows is None:
                if target is not grad[a:b]:
                    grad[a:b].copy_(target)
            else:
                grad.index_copy_(0, rows[a:b], target.to(grad.dtype))
            del x, s, p, target  # free this chunk before the next one is allocated
        return grad, None, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """hidden_c @ weight.T (c, V), into the scratch's float32 buffer when the model is float32."""
    if hidden.dtype == torch.float32:
        return torch.matmul(hidden, weight.t(), out=scratch.s[: hidden.shape[0]])
    return hidden @ weight.t()


def _linear_grads(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor | None,
) -> None:
    """From one chunk's float32 d/d logits (c, V): writes grad_hidden (c, H) and adds into the
    float32 grad_weight (V, H), when given."""
    g = grad_logits.to(hidden.dtype)
    grad_hidden.copy_(g @ weight)
    if grad_weight is not None:
        grad_weight.addmm_(g.t().float() if g.dtype != torch.float32 else g.t(), hidden.float())


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,), temperature, chunk_tokens, truncation) ->
    (logprob, entropy) (N,) fp32."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        temperature,
        chunk_tokens,
        truncation: Truncation = NO_TRUNCATION,
    ):
        n = hidden.shape[0]
        # logprob, entropy, mean_s, threshold
        out = torch.empty(4, n, dtype=torch.float32, device=hidden.device)
        scratch = _Scratch(min(n, chunk_tokens), weight.shape[0], hidden.device)
        for a, b in _spans(n, chunk_tokens):
            logits = _logits(hidden[a:b], weight, scratch)  # (c, V), our own
            _forward_chunk(
                logits, True, targets[a:b], temperature, truncation, out[:, a:b], scratch
            )
            del logits
        ctx.save_for_backward(hidden, weight, targets, out[2], out[3])
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.truncated = truncation.cuts(weight.shape[0])
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets, mean_s, thresholds = ctx.saved_tensors
        g_logprob, g_entropy = _zero_if_none(g_logprob, targets), _zero_if_none(g_entropy, targets)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, H)
        scratch = _Scratch(min(hidden.shape[0], ctx.chunk_tokens), weight.shape[0], hidden.device)
        for a, b in _spans(hidden.shape[0], ctx.chunk_tokens):
            s = _scores(
                _logits(hidden[a:b], weight, scratch),
                ctx.temperature,
                True,
                targets[a:b],
                thresholds[a:b] if ctx.truncated else None,
                scratch.s[: b - a],
            )  # recomputed
            p, _ = _probabilities(s, scratch.p[: b - a])  # the backward reuses the forward's mean_s
            _write_grad(
                s, p, targets[a:b], mean_s[a:b], g_logprob[a:b], g_entropy[a:b], ctx.temperature, s
            )
            del p
            _linear_grads(s, hidden[a:b], weight, grad_hidden[a:b], grad_weight)
            del s
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


class PolicyLossFromHidden(torch.autograd.Function):
    """sum_t token_weight_t * l_t from hidden states, for token-level losses; returns (loss scalar,
    stats (4, N): logprob, entropy, kl, clipped). old/ref may be None (on-policy / no reference).

    Every input of the loss is known in the forward, so the gradients are computed there, chunk by
    chunk: three matmuls a chunk (the logits, then the gradients of the hidden states and of the
    weight) instead of the four of ``LogprobsFromHidden`` followed by the loss, whose backward
    recomputes each chunk's logits (the Triton kernel does the same). l_t and its derivatives in
    logprob_t and entropy_t come from grpo_ds.algo.policy_loss.token_losses itself, by autograd on
    the chunk's (c,) vectors, so the values are those of the unfused path. The backward scales the
    stored gradients by the incoming one, in place: it runs once (no retain_graph, no double
    backward).
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        old,
        ref,
        advantages,
        token_weight,
        cfg,
        temperature,
        chunk_tokens,
        truncation: Truncation = NO_TRUNCATION,
    ):
        # the reference formulas (grpo_ds/algo imports no kernels)
        from grpo_ds.algo.policy_loss import token_losses

        n = hidden.shape[0]
        # forward itself runs under no_grad
        with_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # w*loss, logprob, entropy, kl, clipped
        stats = torch.empty(5, n, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None  # (N, H)
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )  # (V, H)
        scratch = _Scratch(min(n, chunk_tokens), weight.shape[0], hidden.device)
        for a, b in _spans(n, chunk_tokens):
            logits = _logits(hidden[a:b], weight, scratch)  # (c, V)
            sets = support.find_if_cut(logits, temperature, truncation)
            s = _scores(
                logits,
                temperature,
                True,
                targets[a:b],
                None if sets is None else sets.thresholds,
                scratch.s[: b - a],
            )  # (c, V), our own
            del logits
            p, lse, mean_s, logprob = _row_stats(s, targets[a:b], scratch)
            with torch.enable_grad():
                lp = logprob.detach().requires_grad_(with_grad)  # (c,)
                ent = (lse - mean_s).requires_grad_(with_grad)  # (c,)
                per_token, kl, clipped = token_losses(
                    lp, _rows(old, a, b), advantages[a:b].float(), _rows(ref, a, b), ent, cfg
                )
                weighted = per_token * token_weight[a:b].float()  # (c,)
                if with_grad:
                    g_lp, g_ent = torch.autograd.grad(weighted.sum(), (lp, ent), allow_unused=True)
            stats[0, a:b], stats[1, a:b], stats[2, a:b] = weighted.detach(), logprob, ent.detach()
            stats[3, a:b], stats[4, a:b] = kl.detach(), clipped
            if with_grad:
                _write_grad(
                    s,
                    p,
                    targets[a:b],
                    mean_s,
                    _zero_if_none(g_lp, lp),
                    _zero_if_none(g_ent, lp),
                    temperature,
                    s,
                )  # s now holds d loss / d logits_c
                _linear_grads(s, hidden[a:b], weight, grad_hidden[a:b], grad_weight)
            del p, s
        # kept as attributes, not saved tensors: the backward hands them on without a copy
        ctx.grad_hidden, ctx.grad_weight, ctx.weight_dtype = grad_hidden, grad_weight, weight.dtype
        loss, token_stats = stats[0].sum(), stats[1:].clone()  # (), (4, N)
        ctx.mark_non_differentiable(token_stats)
        return loss, token_stats

    @staticmethod
    def backward(ctx, g_loss, _g_stats):
        grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
        ctx.grad_hidden = ctx.grad_weight = None
        if grad_hidden is not None:
            grad_hidden.mul_(g_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(g_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def _rows(values: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if values is None else values[a:b]
