"""The torch path of the kernels (grpo_ds/kernels/chunked.py): chunking over tokens changes nothing
but the memory, whatever chunk_tokens is, and the backward assembles every chunk's gradient."""

import pytest
import torch

from grpo_ds import kernels
from grpo_ds.algo.truncation import Truncation
from tests.kernels.test_fused_linear import compare_logprobs, hidden_inputs
from tests.kernels.test_logprobs import compare_logits, logits_inputs
from tests.kernels.tolerances import assert_close, evaluate

F32, BF16 = torch.float32, torch.bfloat16


# 10 scored tokens: chunks of 1, 3 and 4 (the last one partial), one chunk of exactly N, one larger
# than N.
@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, 10, 64])
def test_logits_any_chunking(chunk_tokens):
    compare_logits(
        "torch",
        F32,
        num_rows=12,
        num_scored=10,
        vocab=103,
        temperature=0.8,
        chunk_tokens=chunk_tokens,
    )


@pytest.mark.parametrize("chunk_tokens", [1, 3, 10, 64])
def test_hidden_any_chunking(chunk_tokens):
    compare_logprobs(
        "torch",
        F32,
        num_tokens=10,
        hidden=32,
        vocab=103,
        temperature=0.8,
        chunk_tokens=chunk_tokens,
    )


@pytest.mark.parametrize("chunk_tokens", [1, 4, 64])
def test_truncated_any_chunking(chunk_tokens):
    # each chunk finds its rows' sets; the backward masks by the forward's thresholds
    truncation = Truncation(top_k=20, top_p=0.9)
    compare_logits(
        "torch",
        F32,
        num_rows=12,
        num_scored=10,
        vocab=1000,
        temperature=0.8,
        chunk_tokens=chunk_tokens,
        truncation=truncation,
    )
    compare_logprobs(
        "torch",
        F32,
        num_tokens=10,
        hidden=32,
        vocab=1000,
        temperature=0.8,
        chunk_tokens=chunk_tokens,
        truncation=truncation,
    )


def test_truncation_leaves_float32_logits_unchanged():
    # at temperature 1 the chunks of float32 logits are views of the caller's: the set is cut in a
    # copy
    inputs = logits_inputs(6, 6, 103)
    logits = inputs["logits"].clone()
    kernels.logprobs_from_logits(
        logits, inputs["targets"], None, 1.0, 4, "torch", Truncation(top_k=3)
    )
    assert torch.equal(logits, inputs["logits"])


def test_hidden_bf16_many_chunks():
    # One token per chunk: the weight gradient is a sum of 10 chunk contributions.
    compare_logprobs(
        "torch", BF16, num_tokens=10, hidden=32, vocab=1000, temperature=1.0, chunk_tokens=1
    )


@pytest.mark.parametrize("output", ["logprob", "entropy"])
def test_one_output_used(output):
    # The other output gets no upstream gradient (None in the backward).
    inputs = hidden_inputs(7, 16, 103)
    upstream = {output: torch.randn(7, generator=torch.Generator().manual_seed(1))}

    def chunked(hidden, weight, targets):
        return dict(
            zip(
                ("logprob", "entropy"),
                kernels.logprobs_from_hidden(hidden, weight, targets, 1.0, 3, "torch"),
                strict=True,
            )
        )

    def whole(hidden, weight, targets):
        return dict(
            zip(
                ("logprob", "entropy"),
                kernels.logprobs_from_hidden(hidden, weight, targets, 1.0, 1024, "torch"),
                strict=True,
            )
        )

    got = evaluate(chunked, inputs, ("hidden", "weight"), upstream)
    expected = evaluate(whole, inputs, ("hidden", "weight"), upstream)
    for key in ("grad_hidden", "grad_weight"):
        assert_close(got[key], expected[key], F32, key)


def test_no_tokens():
    inputs = hidden_inputs(1, 16, 103)
    hidden = inputs["hidden"][:0].requires_grad_(True)
    weight = inputs["weight"].requires_grad_(True)
    logprob, entropy = kernels.logprobs_from_hidden(
        hidden, weight, inputs["targets"][:0], chunk_tokens=4
    )
    assert logprob.shape == entropy.shape == (0,)
    logits = logits_inputs(3, 3, 103)["logits"]
    empty = torch.zeros(0, dtype=torch.long)
    logprob, entropy = kernels.logprobs_from_logits(logits, empty, empty, chunk_tokens=4)
    assert logprob.shape == entropy.shape == (0,)


def test_bad_arguments_raise():
    inputs = hidden_inputs(4, 16, 103)
    with pytest.raises(ValueError, match="chunk_tokens"):
        kernels.logprobs_from_hidden(
            inputs["hidden"], inputs["weight"], inputs["targets"], chunk_tokens=0
        )
    with pytest.raises(ValueError, match="temperature"):
        kernels.logprobs_from_hidden(
            inputs["hidden"], inputs["weight"], inputs["targets"], temperature=0.0
        )
    with pytest.raises(ValueError, match=r"\(V, H\)"):
        kernels.logprobs_from_hidden(inputs["hidden"], inputs["weight"][:, :8], inputs["targets"])


def test_chunks_are_sized_by_bytes_from_the_vocabulary_dtype_and_backend():
    """kernels.chunk_tokens_for: the most tokens whose (tokens x vocabulary) working set fits the
    budget."""
    mib = 2**20
    # torch path, float32: the logits (their own float32 copy) and the probabilities, 8 bytes an
    # entry
    assert kernels.chunk_bytes_per_token(151_936, F32, "torch") == 151_936 * 8
    # 55 x 1.16 MiB <= 64 MiB < 56 x
    assert kernels.chunk_tokens_for(151_936, F32, "torch", 64 * mib) == 55
    # torch path, bfloat16: the bf16 logits, then float32 scaled logits and probabilities
    assert kernels.chunk_bytes_per_token(1_000, BF16, "torch") == 1_000 * 10
    # triton: the logits alone, overwritten in place by their gradient
    assert kernels.chunk_tokens_for(151_936, BF16, "triton", 64 * mib) == 220
    # a small vocabulary: any micro-batch
    assert kernels.chunk_tokens_for(103, F32, "torch", 64 * mib) == 81_442
    # at least one token, whatever the budget
    assert kernels.chunk_tokens_for(151_936, F32, "torch", 1) == 1
    for tokens in (55, 220):
        assert (
            tokens
            * kernels.chunk_bytes_per_token(
                151_936, F32 if tokens == 55 else BF16, "torch" if tokens == 55 else "triton"
            )
            <= 64 * mib
        )
