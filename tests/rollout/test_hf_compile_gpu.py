"""rollout.hf_compile on a GPU: the compiled decode step (static cache, inductor, CUDA graphs: mode
"reduce-overhead") samples what the eager path samples, in fp32, with the same sampler log-probs to
rounding; weights synced in place after a compile reach the CUDA graphs. Skips without CUDA."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_ds.rollout.base import SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.hf_compile import CompiledDecode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# fp32 log-probs of the same tokens, eager (dynamic cache, cuBLAS/SDPA kernels) against compiled
# (static cache with masked slots, inductor's Triton kernels, reductions in another order). TF32 is
# off (torch's default for matmuls), so both are fp32 to about 1e-6 relative per layer; 1e-4 leaves
# room for 2 layers and a 1,000-token log-softmax while staying 100x below the gap between two
# tokens' log-probs that a wrong token or a stale weight would show.
LOGPROB_TOL = dict(rtol=1e-4, atol=1e-4)


def test_compiled_decoding_on_cuda_samples_what_eager_samples(monkeypatch):
    # fp32 matmuls (torch's default)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).cuda().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1000, (9 - i % 3,), generator=g).tolist() for i in range(4)]
    eager = HFRolloutEngine(copy.deepcopy(model), 0, 1, batch_prompts=64)
    said = []
    decode = CompiledDecode("cuda", timeout_s=300, say=said.append)
    compiled = HFRolloutEngine(model, 0, 1, batch_prompts=64, compiled=decode)

    def same(sampling):
        a, b = compiled.generate(prompts, 2, sampling), eager.generate(prompts, 2, sampling)
        assert a.response_ids == b.response_ids
        for x, y in zip(a.sampler_logprobs, b.sampler_logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), **LOGPROB_TOL)

    for sampling in (
        SamplingParams(max_new_tokens=12, seed=5, temperature=0.7, top_k=20, top_p=0.9),
        SamplingParams(max_new_tokens=12, temperature=0.0),
    ):
        same(sampling)
    assert said == [] and decode.failed is None, said
    assert hasattr(model, "_compiled_call")  # transformers compiled the decode step
    g = torch.Generator().manual_seed(2)
    update = [
        (name, p.detach().cpu() + 0.05 * torch.randn(p.shape, generator=g))
        for name, p in model.named_parameters()
    ]
    compiled.update_weights(iter(update))
    eager.update_weights(iter(update))
    same(SamplingParams(max_new_tokens=12, seed=9, temperature=1.0))
    assert decode.failed is None
