"""grpo_ds.kernels.logprobs_from_logits (Triton: grpo_ds/kernels/logprobs.py; torch: chunked.py)
against the reference grpo_ds.algo.logprobs, on outputs and gradients; tolerances from
tests/kernels/tolerances.py."""

import pytest
import torch

from grpo_ds import kernels
from grpo_ds.algo.logprobs import token_logprobs_and_entropy
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation, support_mask
from tests.kernels import tolerances
from tests.kernels.tolerances import assert_close, assert_no_worse, compare, evaluate

F32, BF16 = torch.float32, torch.bfloat16


def logits_inputs(
    num_rows: int, num_scored: int, vocab: int, seed: int = 0, device: str = "cpu"
) -> dict:
    """Logits (M, V) spread like a language model's (std 3; with N >= 3 the third scored row
    near-deterministic), the scored rows (N,) in shuffled order (the others must get exactly zero
    gradient), and targets (N,) that include the first and the last vocabulary entry (the last one
    sits in the final, partial vocabulary block)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(num_rows, vocab, generator=gen)  # (M, V)
    rows = torch.randperm(num_rows, generator=gen)[:num_scored]  # (N,)
    targets = torch.randint(0, vocab, (num_scored,), generator=gen)  # (N,)
    targets[0] = vocab - 1
    if num_scored > 1:
        targets[1] = 0
    if num_scored > 2:  # p(target) ~ 1: logprob ~ 0, entropy ~ 0, and 1 - p cancels in the gradient
        logits[rows[2], targets[2]] = 25.0
    return {"logits": logits.to(device), "rows": rows.to(device), "targets": targets.to(device)}


def upstream_grads(num_scored: int, seed: int = 1, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "logprob": torch.randn(num_scored, generator=gen).to(device),
        "entropy": torch.randn(num_scored, generator=gen).to(device),
    }


def sampled_targets(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    truncation: Truncation,
    seed: int = 0,
) -> torch.Tensor:
    """``targets`` (N,) for ``logits`` (N, V) with every other one (the first, second and third
    excepted: the last vocabulary entry, the first one, a near-certain token) replaced by a token
    drawn from the truncated distribution, as a sampler's would be; the others stay arbitrary,
    mostly outside the set (the trainer keeps them in it)."""
    if not truncation.cuts(logits.shape[1]):
        return targets
    keep = support_mask(logits, targets, temperature, truncation)
    probs = torch.softmax((logits.float() / temperature).masked_fill(~keep, float("-inf")), dim=-1)
    drawn = torch.multinomial(
        probs.cpu(), 1, generator=torch.Generator().manual_seed(seed)
    ).squeeze(1)
    out = targets.clone()
    out[3::2] = drawn[3::2].to(targets.device)
    return out


def kernel(
    backend: str,
    temperature: float,
    chunk_tokens: int = 1024,
    truncation: Truncation = NO_TRUNCATION,
):
    def fn(logits, rows, targets):
        logprob, entropy = kernels.logprobs_from_logits(
            logits, targets, rows, temperature, chunk_tokens, backend, truncation
        )
        return {"logprob": logprob, "entropy": entropy}

    return fn


def reference(temperature: float, truncation: Truncation = NO_TRUNCATION):
    def fn(logits, rows, targets):
        logprob, entropy = token_logprobs_and_entropy(
            logits[rows], targets, temperature=temperature, truncation=truncation
        )
        return {"logprob": logprob, "entropy": entropy}

    return fn


def compare_logits(
    backend: str,
    dtype: torch.dtype,
    num_rows: int,
    num_scored: int,
    vocab: int,
    temperature: float,
    chunk_tokens: int = 1024,
    device: str = "cpu",
    seed: int = 0,
    truncation: Truncation = NO_TRUNCATION,
) -> None:
    """Outputs and logits gradient of one backend against the reference; unscored rows get exactly
    0."""
    inputs = logits_inputs(num_rows, num_scored, vocab, seed, device)
    inputs["targets"] = sampled_targets(
        inputs["logits"][inputs["rows"]], inputs["targets"], temperature, truncation
    )
    got = compare(
        kernel(backend, temperature, chunk_tokens, truncation),
        reference(temperature, truncation),
        inputs,
        dtype,
        low_precision=("logits",),
        differentiable=("logits",),
        upstream=upstream_grads(num_scored, seed + 1, device),
        what=f"{backend} V={vocab} T={temperature} {truncation}",
    )
    unscored = torch.ones(num_rows, dtype=torch.bool, device=device)
    unscored[inputs["rows"]] = False
    assert torch.equal(got["grad_logits"][unscored], torch.zeros_like(got["grad_logits"][unscored]))


# V = 103 and 1000: one vocabulary block (next power of two) with masked lanes; 5003: two blocks of
# 4096, the second partial, so the online log-sum-exp really rescales.
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("vocab", "temperature"), [(103, 1.0), (1000, 0.7), (5003, 1.3)])
def test_matches_reference(backend, dtype, vocab, temperature):
    compare_logits(
        backend,
        dtype,
        num_rows=6,
        num_scored=4,
        vocab=vocab,
        temperature=temperature,
        chunk_tokens=3,
    )


# The sampler's set (grpo_ds.algo.truncation): top-k alone, top-p alone (on 1,000 tokens its
# candidates are the first 64, else the row is sorted), both at once; on 5,003 tokens at top_p 0.99
# and T 1.3, the 1,024 candidates hold too little of the mass of some rows, which sort their whole
# row (grpo_ds.kernels.support's fallback).
TRUNCATIONS = [
    (103, 1.0, Truncation(top_k=3)),
    (1000, 0.7, Truncation(top_p=0.7)),
    (5003, 1.3, Truncation(top_k=20, top_p=0.9)),
    (5003, 1.3, Truncation(top_p=0.99)),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("vocab", "temperature", "truncation"), TRUNCATIONS, ids=str)
def test_truncated_matches_reference(backend, dtype, vocab, temperature, truncation):
    compare_logits(
        backend,
        dtype,
        num_rows=9,
        num_scored=8,
        vocab=vocab,
        temperature=temperature,
        chunk_tokens=3,
        truncation=truncation,
    )


def test_large_vocabulary(backend):
    # V = 32000 (8 Triton blocks): sums over many logits, where the order of accumulation shows.
    compare_logits(
        backend, F32, num_rows=4, num_scored=3, vocab=32000, temperature=1.0, chunk_tokens=2
    )


def test_single_row(backend):
    compare_logits(backend, F32, num_rows=1, num_scored=1, vocab=103, temperature=0.9)


def test_only_logprob_used(backend):
    # The entropy gets no upstream gradient (None reaches the backward): the gradient is that of
    # logprob alone.
    inputs = logits_inputs(5, 5, 1000, seed=3)
    upstream = {"logprob": upstream_grads(5)["logprob"]}
    got = evaluate(kernel(backend, 1.0), inputs, ("logits",), upstream)
    expected = evaluate(reference(1.0), inputs, ("logits",), upstream)
    assert_close(got["grad_logits"], expected["grad_logits"], F32, "grad_logits")


@pytest.mark.parametrize("num_scored", [4, 5])
def test_column_slice_of_wider_logits(backend, num_scored):
    # A vocabulary padded for the GEMM (e.g. Qwen's 151936 columns for a smaller tokenizer) is
    # sliced to the real vocabulary: rows are then not contiguous with each other (row stride 40,
    # width 33). The gradient of the slice must land in the right place, and the padding columns get
    # exactly 0. (With 5 of 5 rows scored the Triton backward skips zero-filling the gradient.)
    inputs = logits_inputs(5, num_scored, 40, seed=4)
    wide = inputs.pop("logits")  # (5, 40)
    upstream = upstream_grads(num_scored)

    def sliced(fn):
        return lambda wide, rows, targets: fn(wide[:, :33], rows, targets.clamp(max=32))

    got = evaluate(sliced(kernel(backend, 1.0)), {"wide": wide, **inputs}, ("wide",), upstream)
    expected = evaluate(sliced(reference(1.0)), {"wide": wide, **inputs}, ("wide",), upstream)
    for key in ("logprob", "entropy", "grad_wide"):
        assert_close(got[key], expected[key], F32, key.replace("wide", "logits"))
    assert torch.equal(got["grad_wide"][:, 33:], torch.zeros(5, 7))


def test_no_grad_and_no_rows(backend):
    inputs = logits_inputs(4, 4, 103)
    with torch.no_grad():
        logprob, entropy = kernels.logprobs_from_logits(
            inputs["logits"].requires_grad_(True),
            inputs["targets"],
            inputs["rows"],
            backend=backend,
        )
    assert not logprob.requires_grad and logprob.dtype == entropy.dtype == F32
    expected = reference(1.0)(inputs["logits"].detach(), inputs["rows"], inputs["targets"])
    assert_close(logprob, expected["logprob"], F32, "logprob")
    empty = torch.zeros(0, dtype=torch.long)
    logprob, entropy = kernels.logprobs_from_logits(inputs["logits"], empty, empty, backend=backend)
    assert logprob.shape == entropy.shape == (0,)


def test_triton_rows_must_be_distinct(triton_backend):
    inputs = logits_inputs(4, 2, 103)
    with pytest.raises(ValueError, match="distinct"):
        kernels.logprobs_from_logits(
            inputs["logits"], inputs["targets"], torch.tensor([1, 1]), backend=triton_backend
        )


def test_fp32_tolerance_rejects_bf16_arithmetic():
    # The fp32 table must be able to fail: a kernel that did its softmax in bf16 (a plausible bug:
    # forgetting the upcast) is off by ~1e-3 relative and must be rejected, while the reference
    # itself passes.
    inputs = logits_inputs(6, 6, 1000, seed=5)
    truth = reference(1.0)(**inputs)
    scaled = inputs["logits"].to(BF16)
    bf16_logprob = (scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)).gather(
        -1, inputs["targets"][:, None]
    )
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(bf16_logprob.squeeze(-1).float(), truth["logprob"], F32, "logprob")
    assert_close(truth["logprob"].clone(), truth["logprob"], F32, "logprob")
    assert tolerances.FP32["logprob"].rel < 1e-4


def test_three_way_check_rejects_a_less_precise_kernel():
    # The bf16 check must be able to fail too: log-probs from logits rounded further, to 8-bit
    # floats (3 mantissa bits instead of bf16's 7), are much further from the float32 truth than the
    # bf16 reference is.
    inputs = logits_inputs(6, 4, 1000, seed=6)
    truth = reference(1.0)(**inputs)
    low_reference = reference(1.0)(**{**inputs, "logits": inputs["logits"].to(BF16)})
    fp8 = reference(1.0)(**{**inputs, "logits": inputs["logits"].to(torch.float8_e4m3fn).to(BF16)})
    for key in ("logprob", "entropy"):
        with pytest.raises(AssertionError, match="kernel error"):
            assert_no_worse(fp8[key], low_reference[key], truth[key], key)
        assert_no_worse(low_reference[key], low_reference[key], truth[key], key)
