"""Triton: log-probs, entropy and the policy loss straight from hidden states and the lm_head
weight.

Full logits never exist. Tokens are processed ``chunk_tokens`` at a time: logits_c = hidden_c @
weight.T (one (chunk, V) matmul in the hidden dtype), then the row kernels read logits_c in
vocabulary blocks (online log-sum-exp) and write its gradient in place, and two matmuls turn it into
the gradients of hidden_c and the weight. So at most one chunk of logits is alive, in the model's
dtype; the weight gradient is accumulated in float32.

Two functions:
- LogprobsFromHidden: (log-prob, entropy) per token, any downstream loss. The backward recomputes
  each chunk's logits (4 matmuls per chunk over forward + backward).
- PolicyLossFromHidden: the whole per-token loss (grpo_ds.algo.policy_loss) weighted per token and
  summed. Every input of the loss is known in the forward, so gradients are computed there (3
  matmuls per chunk) and the backward only scales them by the incoming gradient.
The weight may be a ZeRO-3 parameter: call these inside the lm_head module's forward, where
DeepSpeed has gathered it (grpo_ds.step.loss swaps the lm_head's forward for one micro-batch to do
so). Under truncated sampling each chunk's logits give each row's threshold of the sampler's set
(grpo_ds.kernels.support: a top-k over the chunk, a few floats per row) before the row kernels run
over that set.

Where the time goes (H200, 16,384 tokens x hidden 4,096 x vocab 151,936 bf16, chunks of 1,024:
123 ms full, eager 133 ms): the three matmuls per chunk are eager's three (about 29 ms each at
~700 TFLOP/s), and summing each chunk's (V, H) weight gradient into the float32 accumulator reads
and writes it once a chunk (about 7.5 GB a chunk, ~1.8 ms: ~29 ms over 16 chunks), so larger chunks
pay less; the row kernel reads a chunk's logits twice and writes them once. "forward" alone looks
slow against eager's because it already holds the backward's work. ``FusedTuning`` picks the row
kernels' launch and how the weight gradient is summed; benchmarks/bench_fused_linear.py --sweep
times them, and each part of the forward on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from grpo_ds.algo.policy_loss import LossConfig
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation
from grpo_ds.kernels import support
from grpo_ds.kernels.logprobs import rows_backward, rows_forward
from grpo_ds.kernels.token_math import (
    DEFAULT_LAUNCH,
    KL_CODES,
    Launch,
    row_grad,
    row_logprob_entropy,
    token_loss,
)

# How the chunks' weight gradients are summed (FusedTuning.weight_grad_sum):
#   fp32        each chunk's product in the model dtype (tensor cores), added into a float32
#               accumulator
#   fp32-gemm   the product added into the float32 accumulator by the matmul itself (torch.addmm's
#               out_dtype: CUDA, bf16/fp16 inputs), without the chunk-sized temporary and the
#               separate add
#   model-dtype the sum kept in the model dtype by the matmul (beta 1): no float32 accumulator, one
#               rounding to bf16 per chunk instead of one in all (less precise)
WEIGHT_GRAD_SUMS = ("fp32", "fp32-gemm", "model-dtype")


@dataclass(frozen=True)
class FusedTuning:
    """The knobs of PolicyLossFromHidden besides the chunk size: the row kernel's launch and the
    weight gradient's sum (WEIGHT_GRAD_SUMS). The defaults are what ran on the H200
    (benchmarks/RESULTS.md, 2026-11-26)."""

    rows: Launch = DEFAULT_LAUNCH
    weight_grad_sum: str = "fp32"

    def __post_init__(self) -> None:
        if self.weight_grad_sum not in WEIGHT_GRAD_SUMS:
            raise ValueError(
                f"weight_grad_sum must be one of {WEIGHT_GRAD_SUMS}, got {self.weight_grad_sum!r}"
            )


DEFAULT_TUNING = FusedTuning()


def _spans(n: int, chunk_tokens: int):
    return [(a, min(a + chunk_tokens, n)) for a in range(0, n, chunk_tokens)]


def new_weight_grad(weight: torch.Tensor, weight_grad_sum: str = "fp32") -> torch.Tensor:
    """The zeroed accumulator of the weight gradient: float32, or the model dtype for
    "model-dtype"."""
    dtype = weight.dtype if weight_grad_sum == "model-dtype" else torch.float32
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


def accumulate_weight_grad(
    grad_weight: torch.Tensor,
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight_grad_sum: str = "fp32",
) -> None:
    if grad_logits.dtype == grad_weight.dtype:  # float32 inputs, or the sum kept in the model dtype
        grad_weight.addmm_(grad_logits.t(), hidden.to(grad_weight.dtype))
    elif weight_grad_sum == "fp32-gemm":
        torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
    else:  # the product in the model dtype (tensor cores), the sum over chunks in float32
        grad_weight.add_(grad_logits.t() @ hidden)


def _thresholds(
    logits: torch.Tensor, temperature: float, truncation: Truncation
) -> torch.Tensor | None:
    """One chunk's thresholds of the sampler's set, in logit units; None where nothing is cut."""
    sets = support.find_if_cut(logits, temperature, truncation)
    return None if sets is None else sets.thresholds


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,), temperature, chunk_tokens, truncation) ->
    (logprob, entropy), (N,) fp32."""

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
        # (4, N): logprob, entropy, lse, threshold
        out = torch.empty(4, n, dtype=torch.float32, device=hidden.device)
        for a, b in _spans(n, chunk_tokens):
            logits = hidden[a:b] @ weight.t()  # (c, V)
            rows = torch.arange(b - a, device=hidden.device)
            thresholds = _thresholds(logits, temperature, truncation)
            lp, ent, lse = rows_forward(
                logits, rows, targets[a:b], temperature, thresholds=thresholds
            )
            out[0, a:b], out[1, a:b], out[2, a:b] = lp, ent, lse
            out[3, a:b] = float("-inf") if thresholds is None else thresholds
        ctx.save_for_backward(hidden, weight, targets, out[2], out[1], out[3])
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.truncated = truncation.cuts(weight.shape[0])
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets, lse, entropy, thresholds = ctx.saved_tensors
        g_logprob = torch.zeros_like(lse) if g_logprob is None else g_logprob.float()
        g_entropy = torch.zeros_like(lse) if g_entropy is None else g_entropy.float()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, H)
        for a, b in _spans(hidden.shape[0], ctx.chunk_tokens):
            logits = hidden[a:b] @ weight.t()  # (c, V), recomputed
            rows = torch.arange(b - a, device=hidden.device)
            rows_backward(
                logits,
                rows,
                targets[a:b],
                ctx.temperature,
                lse[a:b],
                entropy[a:b],
                g_logprob[a:b],
                g_entropy[a:b],
                logits,  # in place: logits now hold their gradient
                thresholds=thresholds[a:b] if ctx.truncated else None,
            )
            grad_hidden[a:b] = logits @ weight
            accumulate_weight_grad(grad_weight, logits, hidden[a:b])
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


@triton.jit
def _policy_loss_rows(
    logits_ptr,
    row_stride,
    targets_ptr,
    thresholds_ptr,
    old_ptr,
    ref_ptr,
    adv_ptr,
    weight_ptr,
    stats_ptr,
    V,
    inv_temp,
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    entropy_coef,
    HAS_OLD: tl.constexpr,
    KL: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    WITH_GRAD: tl.constexpr,
    TRUNCATED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # stats (5, N): weighted loss, logprob, entropy, kl, clipped. With WITH_GRAD the row's logits
    # are overwritten by d(weight * loss) / d logits.
    i = tl.program_id(0).to(tl.int64)
    n = tl.num_programs(0).to(tl.int64)
    row_ptr = logits_ptr + i * row_stride
    target = tl.load(targets_ptr + i).to(tl.int64)
    threshold = tl.load(thresholds_ptr + i) if TRUNCATED else float("-inf")
    logprob, entropy, lse = row_logprob_entropy(
        row_ptr, target, V, inv_temp, threshold, TRUNCATED, BLOCK_V
    )
    old = tl.load(old_ptr + i) if HAS_OLD else logprob
    ref = tl.load(ref_ptr + i) if KL != 0 else logprob
    w = tl.load(weight_ptr + i)
    loss, kl, clipped, g_logprob = token_loss(
        logprob,
        old,
        ref,
        tl.load(adv_ptr + i),
        entropy,
        clip_low,
        clip_high,
        dual_clip,
        kl_coef,
        entropy_coef,
        KL,
        DUAL_CLIP,
    )
    tl.store(stats_ptr + i, w * loss)
    tl.store(stats_ptr + n + i, logprob)
    tl.store(stats_ptr + 2 * n + i, entropy)
    tl.store(stats_ptr + 3 * n + i, kl)
    tl.store(stats_ptr + 4 * n + i, clipped)
    if WITH_GRAD:
        row_grad(
            row_ptr,
            row_ptr,
            target,
            V,
            inv_temp,
            lse,
            entropy,
            w * g_logprob,
            -w * entropy_coef,
            threshold,
            TRUNCATED,
            BLOCK_V,
        )


class PolicyLossFromHidden(torch.autograd.Function):
    """sum_t token_weight_t * l_t from hidden states; returns (loss scalar, stats (4, N): logprob,
    entropy, kl, clipped). old/ref may be None (on-policy / no reference)."""

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
        cfg: LossConfig,
        temperature,
        chunk_tokens,
        truncation: Truncation = NO_TRUNCATION,
        tuning: FusedTuning = DEFAULT_TUNING,
    ):
        n = hidden.shape[0]
        # forward itself runs under no_grad
        with_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        stats = torch.empty(5, n, dtype=torch.float32, device=hidden.device)  # (5, N)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = new_weight_grad(weight, tuning.weight_grad_sum) if with_grad else None
        kl_code = KL_CODES[cfg.kl_estimator if ref is not None else None]
        dummy = stats[0]  # stands in for absent old/ref pointers (never read)
        for a, b in _spans(n, chunk_tokens):
            logits = hidden[a:b] @ weight.t()  # (c, V)
            chunk_stats = torch.empty(5, b - a, dtype=torch.float32, device=hidden.device)  # (5, c)
            thresholds = _thresholds(logits, temperature, truncation)
            _policy_loss_rows[(b - a,)](
                logits,
                logits.stride(0),
                targets[a:b],
                dummy if thresholds is None else thresholds,
                dummy if old is None else old[a:b].float().contiguous(),
                dummy if ref is None else ref[a:b].float().contiguous(),
                advantages[a:b].float().contiguous(),
                token_weight[a:b].float().contiguous(),
                chunk_stats,
                logits.shape[1],
                1.0 / temperature,
                cfg.clip_low,
                cfg.clip_high,
                cfg.dual_clip or 0.0,
                cfg.kl_coef,
                cfg.entropy_coef,
                HAS_OLD=old is not None,
                KL=kl_code,
                DUAL_CLIP=cfg.dual_clip is not None,
                WITH_GRAD=with_grad,
                TRUNCATED=thresholds is not None,
                **tuning.rows.options(logits.shape[1]),
            )
            stats[:, a:b] = chunk_stats
            if with_grad:
                grad_hidden[a:b] = logits @ weight
                accumulate_weight_grad(grad_weight, logits, hidden[a:b], tuning.weight_grad_sum)
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        loss, token_stats = stats[0].sum(), stats[1:].clone()  # (), (4, N)
        ctx.mark_non_differentiable(token_stats)
        return loss, token_stats

    @staticmethod
    def backward(ctx, g_loss, _g_stats):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * g_loss,
            grad_weight * g_loss,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )
