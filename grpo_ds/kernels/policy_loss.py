"""Triton: the masked per-token policy loss over a (B, T) batch, reduced to per-sequence sums, fwd
and bwd.

One program per sequence reads its T positions in blocks. ``mask`` holds a weight m_t >= 0 per token
(1/0 for a plain mask; a loss mask times an importance weight in training); tokens with m_t = 0 are
masked out. It returns the weighted sum sum_t m_t l_t of the loss
(grpo_ds.algo.policy_loss.token_losses) and, over masked-in tokens (m_t != 0), the plain sums of the
KL, the entropy, the clipped indicator, and the token count L_i. Those per-sequence sums are the
partial sums of every loss_agg mode (grpo_ds.algo.aggregation: loss = sum_i w_i * sum_t l_it with
w_i from the lengths). Only the loss sums are differentiable, with respect to the log-probs and the
entropy. Masked-out positions are never used, even if they hold inf or NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_ds.algo.policy_loss import LossConfig
from grpo_ds.kernels.token_math import KL_CODES, block_size, token_loss


@triton.jit
def _rows(
    logprob_ptr,
    old_ptr,
    ref_ptr,
    entropy_ptr,
    adv_ptr,
    mask_ptr,
    sums_ptr,
    g_sum_ptr,
    g_logprob_ptr,
    g_entropy_ptr,
    T,
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    entropy_coef,
    HAS_OLD: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    KL: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n_rows = tl.num_programs(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    advantage = tl.load(adv_ptr + row)
    g_sum = tl.load(g_sum_ptr + row) if BACKWARD else 0.0
    # loss, kl, entropy, clipped, tokens (padded to a power of two)
    sums = tl.zeros((8,), tl.float32)
    for start in range(0, T, BLOCK_T):
        cols = start + offs
        inside = cols < T
        at = row * T + cols
        m = tl.load(mask_ptr + at, mask=inside, other=0).to(tl.float32)
        keep = (m != 0) & inside
        logprob = tl.where(
            keep, tl.load(logprob_ptr + at, mask=keep, other=0.0).to(tl.float32), 0.0
        )
        old = (
            tl.where(keep, tl.load(old_ptr + at, mask=keep, other=0.0).to(tl.float32), 0.0)
            if HAS_OLD
            else logprob
        )
        ref = (
            tl.where(keep, tl.load(ref_ptr + at, mask=keep, other=0.0).to(tl.float32), 0.0)
            if KL != 0
            else logprob
        )
        entropy = (
            tl.where(keep, tl.load(entropy_ptr + at, mask=keep, other=0.0).to(tl.float32), 0.0)
            if HAS_ENTROPY
            else 0.0 * logprob
        )
        advantages = advantage + 0.0 * logprob  # a block, like the other operands
        loss, kl, clipped, g_logprob = token_loss(
            logprob,
            old,
            ref,
            advantages,
            entropy,
            clip_low,
            clip_high,
            dual_clip,
            kl_coef,
            entropy_coef,
            KL,
            DUAL_CLIP,
        )
        if BACKWARD:
            tl.store(g_logprob_ptr + at, tl.where(keep, g_sum * m * g_logprob, 0.0), mask=inside)
            if HAS_ENTROPY:
                tl.store(
                    g_entropy_ptr + at, tl.where(keep, -g_sum * m * entropy_coef, 0.0), mask=inside
                )
        else:
            pick = tl.arange(0, 8)
            sums += tl.where(pick == 0, tl.sum(tl.where(keep, m * loss, 0.0), axis=0), 0.0)
            sums += tl.where(pick == 1, tl.sum(tl.where(keep, kl, 0.0), axis=0), 0.0)
            sums += tl.where(pick == 2, tl.sum(tl.where(keep, entropy, 0.0), axis=0), 0.0)
            sums += tl.where(pick == 3, tl.sum(tl.where(keep, clipped, 0.0), axis=0), 0.0)
            sums += tl.where(pick == 4, tl.sum(tl.where(keep, 1.0, 0.0), axis=0), 0.0)
    if not BACKWARD:
        pick = tl.arange(0, 8)
        tl.store(sums_ptr + pick * n_rows + row, sums, mask=pick < 5)


def _launch(inputs, cfg: LossConfig, sums, g_sum, g_logprob, g_entropy, backward: bool) -> None:
    logprobs, old, ref, entropy, advantages, mask = inputs
    n_rows, width = logprobs.shape
    if n_rows == 0 or width == 0:
        return
    dummy = advantages  # stands in for absent tensors (never read)

    def ptr(t):
        return dummy if t is None else t

    _rows[(n_rows,)](
        logprobs,
        ptr(old),
        ptr(ref),
        ptr(entropy),
        advantages,
        mask,
        ptr(sums),
        ptr(g_sum),
        ptr(g_logprob),
        ptr(g_entropy),
        width,
        cfg.clip_low,
        cfg.clip_high,
        cfg.dual_clip or 0.0,
        cfg.kl_coef,
        cfg.entropy_coef,
        HAS_OLD=old is not None,
        HAS_ENTROPY=entropy is not None,
        KL=KL_CODES[cfg.kl_estimator if ref is not None else None],
        DUAL_CLIP=cfg.dual_clip is not None,
        BACKWARD=backward,
        BLOCK_T=block_size(width, cap=1024),
    )


class MaskedPolicyLoss(torch.autograd.Function):
    """(logprobs, old|None, ref|None, entropy|None (B, T), advantages (B,), mask (B, T), cfg) ->
    sums (5, B): loss, kl, entropy, clipped, tokens per sequence; row 0 is differentiable."""

    @staticmethod
    def forward(ctx, logprobs, old, ref, entropy, advantages, mask, cfg: LossConfig):
        inputs = tuple(None if t is None else t.contiguous() for t in (logprobs, old, ref, entropy))
        inputs += (advantages.float().contiguous(), mask.contiguous())
        # (5, B)
        sums = torch.zeros(5, logprobs.shape[0], dtype=torch.float32, device=logprobs.device)
        _launch(inputs, cfg, sums, None, None, None, backward=False)
        ctx.save_for_backward(*[t if t is not None else torch.empty(0) for t in inputs])
        ctx.absent = tuple(t is None for t in inputs)
        ctx.cfg = cfg
        return sums

    @staticmethod
    def backward(ctx, g_sums):
        inputs = tuple(
            None if gone else t for t, gone in zip(ctx.saved_tensors, ctx.absent, strict=True)
        )
        logprobs, entropy = inputs[0], inputs[3]
        # (B, T)
        g_logprob = torch.empty(logprobs.shape, dtype=torch.float32, device=logprobs.device)
        g_entropy = None if entropy is None else torch.empty_like(g_logprob)
        _launch(
            inputs,
            ctx.cfg,
            None,
            g_sums[0].float().contiguous(),
            g_logprob,
            g_entropy,
            backward=True,
        )
        return (
            g_logprob.to(logprobs.dtype),
            None,
            None,
            None if g_entropy is None else g_entropy.to(entropy.dtype),
            None,
            None,
            None,
        )
