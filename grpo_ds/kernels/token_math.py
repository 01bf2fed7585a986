"""Triton device functions shared by the kernels: one row's log-prob/entropy and the per-token loss.

Row math (one token position, s = logits / temperature over the vocabulary V, target y):

    lse = logsumexp(s)               computed online over vocabulary blocks (running max m, running
                                     sum d)
    E   = sum_v p_v s_v              carried online alongside d, so the row is read once
    logprob = s_y - lse,  entropy = lse - E
    d logprob / d s_v = [v == y] - p_v,   d entropy / d s_v = -p_v (s_v - E),   d s / d logits = 1 /
                                          temperature

Under truncated sampling (TRUNCATED) the sums run over the sampler's set: the tokens whose logit is
not below the row's ``threshold`` (grpo_ds.kernels.support), and the target; p_v is 0 outside it
(grpo_ds.algo.truncation).

Per-token loss: grpo_ds.algo.policy_loss (PPO clip with low/high and dual clip, k1/k2/k3 KL, entropy
bonus); the functions here return its value and its derivative with respect to the log-prob in
closed form. All arithmetic is float32 whatever the storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

# KL estimator codes passed as a constexpr: 0 = no reference model.
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3}


@triton.jit
def in_support(x, cols, target, threshold):
    """The lanes of the sampler's set: logits ``x`` not below ``threshold`` (NaN included, so that
    it reaches the loss), and the target."""
    return (x >= threshold) | (x != x) | (cols == target)


@triton.jit
def row_logprob_entropy(
    row_ptr, target, V, inv_temp, threshold, TRUNCATED: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Return (logprob, entropy, lse) of one row of V logits at ``row_ptr`` (contiguous); with
    TRUNCATED, over the sampler's set (``threshold``, see in_support)."""
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    e = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        # a block may hold no token of the set: its maximum is then -inf, and so may m be
        if TRUNCATED:
            mask = mask & in_support(x, cols, target, threshold)
        s = tl.where(mask, x * inv_temp, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - (-inf)) would be NaN
        rescale = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe)  # unnormalised; 0 on masked lanes
        d = d * rescale + tl.sum(p, axis=0)
        e = e * rescale + tl.sum(p * tl.where(mask, s, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(d)
    s_target = tl.load(row_ptr + target).to(tl.float32) * inv_temp
    return s_target - lse, lse - e / d, lse


@triton.jit
def row_grad(
    row_ptr,
    grad_ptr,
    target,
    V,
    inv_temp,
    lse,
    entropy,
    g_logprob,
    g_entropy,
    threshold,
    TRUNCATED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Write d(g_logprob * logprob + g_entropy * entropy) / d logits of one row to ``grad_ptr`` (may
    alias); with TRUNCATED, 0 outside the sampler's set."""
    offs = tl.arange(0, BLOCK_V)
    mean_s = lse - entropy  # E
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        s = x * inv_temp
        p = tl.exp(s - lse)
        if TRUNCATED:
            p = tl.where(in_support(x, cols, target, threshold), p, 0.0)
        g = g_logprob * (tl.where(cols == target, 1.0, 0.0) - p) - g_entropy * p * (s - mean_s)
        tl.store(grad_ptr + cols, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def token_loss(
    logprob,
    old_logprob,
    ref_logprob,
    advantage,
    entropy,
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    entropy_coef,
    KL: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
):
    """Return (loss, kl, clipped, d loss / d logprob) of tokens; d loss / d entropy is
    -entropy_coef."""
    ratio = tl.exp(logprob - old_logprob)
    unclipped = -advantage * ratio
    clipped_loss = -advantage * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    is_clipped = clipped_loss > unclipped
    loss = tl.where(is_clipped, clipped_loss, unclipped)
    grad = tl.where(is_clipped, 0.0, unclipped)
    if DUAL_CLIP:
        bound = -dual_clip * advantage
        use_bound = (advantage < 0) & (bound < loss)
        loss = tl.where(use_bound, bound, loss)
        grad = tl.where(use_bound, 0.0, grad)
        is_clipped = is_clipped | use_bound
    r = ref_logprob - logprob
    if KL == 1:
        kl = -r
        kl_grad = 1.0 + 0.0 * r
    elif KL == 2:
        kl = 0.5 * r * r
        kl_grad = -r
    elif KL == 3:
        rc = tl.minimum(tl.maximum(r, -20.0), 20.0)
        kl = tl.exp(rc) - rc - 1.0
        kl_grad = tl.where((r >= -20.0) & (r <= 20.0), 1.0 - tl.exp(rc), 0.0)
    else:
        kl = 0.0 * r
        kl_grad = 0.0 * r
    loss = loss + kl_coef * kl - entropy_coef * entropy
    grad = grad + kl_coef * kl_grad
    return loss, kl, tl.where(is_clipped, 1.0, 0.0), grad


def block_size(width: int, cap: int = 4096) -> int:
    """The power of two that covers ``width`` elements in one block, at most ``cap``."""
    return min(cap, triton.next_power_of_2(max(int(width), 1)))


@dataclass(frozen=True)
class Launch:
    """How a row kernel (one program per token row, looping over the vocabulary) is launched.
    ``block_v``: vocabulary elements per loop step (None: ``block_size(V)``, at most 4096);
    ``num_warps``: warps per program (None: Triton's default, 4). The defaults ran on the H200
    (benchmarks/RESULTS.md, 2026-11-26); the benchmarks' ``--sweep`` times others at the GPU shapes,
    so a better pair becomes the default here, with its measurement."""

    block_v: int | None = None
    num_warps: int | None = None

    def __post_init__(self) -> None:
        if self.block_v is not None and (self.block_v < 16 or self.block_v & (self.block_v - 1)):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")

    def options(self, vocab: int) -> dict:
        """Keyword arguments of the launch: the BLOCK_V constexpr, and num_warps when set."""
        found = {"BLOCK_V": self.block_v or block_size(vocab)}
        if self.num_warps is not None:
            found["num_warps"] = self.num_warps
        return found

    def name(self) -> str:
        return f"block_v {self.block_v or 'auto'}, warps {self.num_warps or 'default'}"


DEFAULT_LAUNCH = Launch()
