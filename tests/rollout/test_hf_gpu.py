"""The hf engine's token picking on a GPU: the float64 cumulative sum of TokenSampler on CUDA draws
from the right distribution, at a realistic vocabulary too, and the engine's sampler log-probs match
a forward pass there."""

import pytest
import torch

from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout.base import SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine, sample_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def test_cuda_draws_follow_the_distribution_and_never_a_zero_probability_token():
    torch.manual_seed(0)
    probs = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.0, 0.25, 0.2, 0.05], dtype=torch.float64)
    rows = 400_000
    # (B, V), -inf where p = 0
    logprobs = probs.log().float().to(CUDA).expand(rows, -1).contiguous()
    tokens = sample_tokens(logprobs, torch.rand(rows, device=CUDA)).squeeze(-1).cpu()  # (B,)
    counts = torch.bincount(tokens, minlength=len(probs)).double() / rows
    assert counts[probs == 0].sum() == 0
    # binomial standard error at p <= 0.3 and 400k draws is <= 7.3e-4: 5 sigma
    assert (counts - probs).abs().max() < 3.7e-3, counts


def test_cuda_draws_at_a_realistic_vocabulary_stay_in_its_support():
    torch.manual_seed(1)
    vocab, rows = 151_936, 64
    scores = torch.randn(rows, vocab, device=CUDA) * 4
    scores[:, vocab // 2 :] = -torch.inf  # a top-k style cut: the upper half can never be drawn
    tokens = sample_tokens(torch.log_softmax(scores, dim=-1), torch.rand(rows, device=CUDA))
    assert tokens.shape == (rows, 1) and tokens.dtype == torch.int64
    assert bool((tokens >= 0).all()) and bool((tokens < vocab // 2).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_on_cuda_logprobs_match_a_forward_pass(dtype):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=64, num_layers=2, num_heads=2, seed=0).to(
        CUDA, dtype
    )
    engine = HFRolloutEngine(model, tok.pad_token_id, tok.eos_token_id, 64)
    temperature = 0.8
    out = engine.generate(
        [tok.encode("2+2="), tok.encode("10+4=")],
        4,
        SamplingParams(max_new_tokens=6, temperature=temperature, seed=3),
    )
    assert len(out) == 8
    for prompt, response, logprobs in zip(
        out.prompt_ids, out.response_ids, out.sampler_logprobs, strict=True
    ):
        ids = torch.tensor([prompt + response], device=CUDA)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[
                0, len(prompt) - 1 : len(prompt) + len(response) - 1
            ]
        expected = (
            torch.log_softmax(logits.float() / temperature, -1)
            .gather(-1, torch.tensor(response, device=CUDA)[:, None])
            .squeeze(-1)
            .cpu()
        )
        # left-padded batched generate vs one unpadded forward: other kernels, other summation
        # order; in bf16 the logits themselves carry ~3 significant digits
        tol = 1e-3 if dtype == torch.float32 else 6e-2
        torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=tol, atol=tol)
