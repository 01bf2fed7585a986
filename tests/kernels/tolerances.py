"""The kernel tests' tolerances: one table per dtype, a reason for each number, and the comparisons
that use them.

An error is max |actual - expected| / max |expected| over a tensor (relative_error), so one number
serves every shape; a sum whose terms cancel is measured against the sum of their magnitudes instead
(``scales``).

Tables. "measured" is the worst error seen over 5 seeds of every comparison in tests/kernels (the
Triton kernels through the interpreter, and the torch path as of commit 7cbf9b6), plus logits with
V = 151936, a (4 x 64) @ (64 x 32000) lm_head, (8, 2048) masked batches and 512 x 16 rewards. Each
tolerance is a few times the worst measured, or, for bf16 roundings, a bound of one or two bf16 ulp
(2^-7 relative at worst) derived from the roundings involved.

- FP32: kernel and reference on the same float32 inputs. Both compute in float32; they differ only
  in the order of operations (online log-sum-exp over vocabulary blocks vs torch.logsumexp, tile
  sums vs torch.mean, chunked vs whole GEMMs), so every difference is a few float32 ulp (eps =
  2^-23 = 1.2e-7) of the quantities involved, amplified where a result cancels.
- BF16: kernel on bf16 inputs vs the same reference run on the same bf16 inputs (the reference "in
  low precision": bf16 GEMMs, torch's type rules). Where both upcast before computing (log-probs
  from bf16 logits, rewards) the float32 numbers apply; gradients returned in bf16 may round to
  neighbouring bf16 values (one ulp is 2^-7 relative at worst; Triton's CPU interpreter even
  truncates fp32 -> bf16 instead of rounding to nearest, so its values can be a whole ulp off where
  torch's are half an ulp off).
- BF16_ERROR_RATIO: the three-way check (assert_no_worse). Against the float32 reference on the
  unrounded inputs, the kernel's error must be at most this multiple of the low-precision
  reference's error, plus the FP32 tolerance (an error both share exactly, e.g. from rounding the
  inputs, then passes with ratio 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rel: float  # the largest relative_error accepted
    reason: str


FP32: dict[str, Tolerance] = {
    "advantages": Tolerance(
        2e-6,
        "means and stds of <= 16 rewards summed in another order, then divided by the "
        "std: a few ulp of O(1) advantages; measured 4.1e-7",
    ),
    "logprob": Tolerance(
        1e-6,
        "s_y - lse with lse accumulated blockwise over up to 1.5e5 logits: a few ulp of "
        "|lse|; measured 2.1e-7",
    ),
    "entropy": Tolerance(
        2e-5,
        "lse - sum_v p_v s_v cancels to ~0 for a near-deterministic row, leaving ulps of "
        "|lse| ~ 36 against a maximum entropy ~ 7; measured 4.7e-6",
    ),
    "grad_logits": Tolerance(
        2e-4,
        "[v == y] - p_v cancels where p_y ~ 1 (that row's gradient is an ulp-level "
        "difference of O(1) numbers, also in the float32 reference, whose own error "
        "against float64 is the larger one there); measured 5.3e-5 (V = 151936)",
    ),
    "grad_hidden": Tolerance(
        5e-5, "grad_logits @ weight sums V products of the grad_logits above; measured 1.1e-5"
    ),
    "grad_weight": Tolerance(
        2e-5, "grad_logits^T @ hidden over N tokens, chunk by chunk in float32; measured 4.3e-6"
    ),
    "loss": Tolerance(
        2e-6,
        "sum_t w_t l_t from log-probs within ulps, relative to sum_t |w_t l_t|; measured 3.9e-7",
    ),
    "kl": Tolerance(
        1e-5,
        "k1/k2/k3 of r = ref - logprob with logprob ulps off; k3 = exp(r) - r - 1 cancels "
        "for small r; measured 3.0e-6",
    ),
    "clipped": Tolerance(
        0.0, "exact: every ratio is built >= 0.13 (in log space) away from a clip boundary"
    ),
    "seq_loss": Tolerance(
        1e-6, "per-sequence sums of <= 2048 float32 loss terms in another order; measured 1.6e-7"
    ),
    "seq_kl": Tolerance(
        2e-6, "per-sequence sums of float32 KL terms (k3 cancels for small r); measured 5.1e-7"
    ),
    "seq_entropy": Tolerance(
        1e-6, "per-sequence sums of the given entropies in another order; measured 1.6e-7"
    ),
    "seq_clipped": Tolerance(
        0.0, "exact: counts of 0/1 indicators, ratios away from the clip boundaries"
    ),
    "seq_tokens": Tolerance(0.0, "exact: token counts"),
    "grad_logprobs": Tolerance(
        1e-6,
        "upstream x mask x d l_t / d logprob, a product of 3-4 float32 numbers: an "
        "ulp or two; measured 1.9e-7",
    ),
    "grad_entropy": Tolerance(
        1e-6, "-upstream x mask x entropy_coef, one product in another order: an ulp; measured 0"
    ),
}

BF16: dict[str, Tolerance] = {
    "advantages": Tolerance(
        2e-6, "bf16 rewards are upcast exactly and the math is float32: as FP32; measured 2.1e-7"
    ),
    "logprob": Tolerance(
        1e-6,
        "the same bf16 logits (from the same bf16 GEMM: on the GPU test the kernel's one "
        "chunk is the reference's GEMM) are upcast exactly: as FP32; measured 1.3e-7",
    ),
    "entropy": Tolerance(
        2e-5, "as logprob: float32 math on identical values, as FP32; measured 5.3e-6"
    ),
    "grad_logits": Tolerance(
        1.6e-2,
        "both round the same float32 gradient to bf16, to neighbouring values at "
        "worst (one ulp <= 2^-7 of the largest; the interpreter truncates): two ulp "
        "allowed; measured 7.4e-3",
    ),
    "grad_hidden": Tolerance(
        3e-2,
        "bf16 GEMM of grad_logits that differ by an ulp in places, rounded to bf16 "
        "again (2^-7 each): two roundings' worth; measured 1.2e-2, against 6.3e-2 for "
        "bf16 itself vs float32",
    ),
    "grad_weight": Tolerance(
        3e-2,
        "as grad_hidden (the torch path also sums its chunks' bf16 weight gradients "
        "in bf16); measured 1.3e-2",
    ),
    "loss": Tolerance(
        2e-6,
        "float32 loss of log-probs computed from identical bf16 logits: as FP32; measured 5.2e-7",
    ),
    "kl": Tolerance(1e-5, "float32 KL of identical log-probs: as FP32; measured 3.2e-6"),
    "clipped": Tolerance(
        0.0,
        "exact: the ratios stay >= 0.13 (in log space) from the clip boundaries, beyond "
        "what bf16 inputs move a log-prob (<= 0.067)",
    ),
    "seq_loss": Tolerance(
        1e-2,
        "the reference evaluates l_t in bf16 (torch's type rules; ratio = exp(lp - old) "
        "rounded to 2^-9), the Triton kernel in float32; measured 3.3e-3",
    ),
    "seq_kl": Tolerance(
        5e-2,
        "the reference's bf16 k2/k3 (exp(r) - r - 1 cancels for small r, losing most of "
        "bf16's 8 bits) vs the kernel's float32; measured 2.2e-2",
    ),
    "seq_entropy": Tolerance(
        1e-6, "the same bf16 entropies summed in float32 by both: as FP32; measured 1.5e-7"
    ),
    "seq_clipped": Tolerance(
        0.0, "exact: counts of indicators, ratios away from the clip boundaries"
    ),
    "seq_tokens": Tolerance(0.0, "exact: token counts (summed in float32 by both)"),
    "grad_logprobs": Tolerance(
        2e-2,
        "the reference's chain of bf16 products (ratio, -A ratio, x mask, each "
        "rounded) vs the kernel's float32 product rounded once: about two ulp (2^-7 "
        "each); measured 9.8e-3",
    ),
    "grad_entropy": Tolerance(2e-2, "as grad_logprobs; measured 7.1e-3"),
}

BF16_ERROR_RATIO = Tolerance(
    5.0,
    "1 where both make the same roundings; the interpreter truncates to bf16 (an "
    "error up to one ulp where torch's is half an ulp: 2x), and over a small "
    "tensor the reference's largest error can by chance fall well below half an "
    "ulp; measured 3.1 (Triton grad_hidden; the float32 kernel against a bf16 "
    "reference: 2.9, seq_kl)",
)

TABLES: dict[torch.dtype, dict[str, Tolerance]] = {torch.float32: FP32, torch.bfloat16: BF16}

Outputs = dict[str, torch.Tensor]


def relative_error(
    actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None
) -> float:
    """max |actual - expected| / scale, in float64; ``scale`` defaults to max |expected| (the
    absolute error where ``expected`` is all 0)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.detach().double(), expected.detach().double()
    assert bool(torch.isfinite(actual).all()), "non-finite values"
    if actual.numel() == 0:
        return 0.0
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item() if scale is None else scale
    return err / scale if scale > 0 else err


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    key: str,
    what: str = "",
    scale: float | None = None,
) -> None:
    """``actual`` within the ``dtype`` table's tolerance for ``key`` of ``expected`` (see
    relative_error)."""
    tol = TABLES[dtype][key]
    err = relative_error(actual, expected, scale)
    assert err <= tol.rel, f"{what} {key} ({dtype}): relative error {err:.3g} > {tol.rel:.3g}"


def assert_no_worse(
    kernel: torch.Tensor,
    low_reference: torch.Tensor,
    truth: torch.Tensor,
    key: str,
    what: str = "",
    scale: float | None = None,
) -> None:
    """The kernel's error against the fp32 truth is at most a small multiple of the low-precision
    reference's."""
    kernel_err = relative_error(kernel, truth, scale)
    reference_err = relative_error(low_reference, truth, scale)
    bound = BF16_ERROR_RATIO.rel * reference_err + FP32[key].rel
    assert kernel_err <= bound, (
        f"{what} {key}: kernel error {kernel_err:.3g} vs fp32 > {bound:.3g} "
        f"(low-precision reference's error {reference_err:.3g})"
    )


def evaluate(
    fn: Callable[..., Outputs],
    inputs: dict[str, torch.Tensor | None],
    differentiable: Iterable[str] = (),
    upstream: Outputs | None = None,
) -> Outputs:
    """fn(**inputs) and, for each name in ``differentiable``, "grad_<name>" of sum_k <upstream[k],
    output[k]>."""
    differentiable = tuple(differentiable)
    leaves = {
        k: v.detach().clone().requires_grad_(True) if k in differentiable else v
        for k, v in inputs.items()
    }
    outputs = fn(**leaves)
    results = {k: v.detach() for k, v in outputs.items()}
    if differentiable:
        total = sum((outputs[k].double() * g.double()).sum() for k, g in (upstream or {}).items())
        total.backward()
        for k in differentiable:
            grad = leaves[k].grad
            results["grad_" + k] = torch.zeros_like(leaves[k]) if grad is None else grad
    return results


def compare(
    kernel_fn: Callable[..., Outputs],
    reference_fn: Callable[..., Outputs],
    inputs: dict[str, torch.Tensor | None],
    dtype: torch.dtype,
    low_precision: Iterable[str] = (),
    differentiable: Iterable[str] = (),
    upstream: Outputs | None = None,
    what: str = "",
    scales: dict[str, float] | None = None,
) -> Outputs:
    """Compare ``kernel_fn`` with ``reference_fn`` on outputs and gradients; return the kernel's
    results.

    float32: kernel vs reference on the same float32 inputs. Lower precision (three ways): the
    inputs named in ``low_precision`` are rounded to ``dtype``; the kernel must match the reference
    run on those same rounded inputs (with the same dtypes: gradients keep their input's), and its
    error against the float32 reference on the unrounded inputs must be no worse than a small
    multiple of that low-precision reference's error. ``scales`` overrides the magnitude errors are
    measured against for some outputs (a sum whose terms cancel is measured against the sum of their
    magnitudes).
    """
    scales = scales or {}
    differentiable = tuple(differentiable)
    truth = evaluate(reference_fn, inputs, differentiable, upstream)
    if dtype == torch.float32:
        got = evaluate(kernel_fn, inputs, differentiable, upstream)
        for key, expected in truth.items():
            assert got[key].dtype == expected.dtype, (
                f"{what} {key}: dtype {got[key].dtype} != {expected.dtype}"
            )
            assert_close(got[key], expected, dtype, key, what, scales.get(key))
        return got
    low_precision = tuple(low_precision)
    low = {k: v.to(dtype) if v is not None and k in low_precision else v for k, v in inputs.items()}
    low_reference = evaluate(reference_fn, low, differentiable, upstream)
    got = evaluate(kernel_fn, low, differentiable, upstream)
    for key, expected in low_reference.items():
        assert got[key].dtype == expected.dtype, (
            f"{what} {key}: dtype {got[key].dtype} != {expected.dtype}"
        )
        assert_close(got[key], expected, dtype, key, what, scales.get(key))
        assert_no_worse(got[key], expected, truth[key], key, what, scales.get(key))
    return got
