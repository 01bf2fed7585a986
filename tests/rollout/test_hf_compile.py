"""rollout.hf_compile on a CPU: compiled decoding (static cache, inductor) gives the eager path's
samples and sampler log-probs, and a compile that raises or hangs falls back to eager within the
bound, with the same samples.

The compiled tests really compile (inductor's C++ backend, about 1-2 min each on a busy 2-core
machine, faster when inductor's cache in /tmp is warm); the fallback tests replace torch.compile and
take seconds.
"""

import copy
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_ds import session as session_module
from grpo_ds.config.loading import load_recipe
from grpo_ds.model import memory
from grpo_ds.model.memory import ModelShape
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout.base import SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.hf_compile import CompiledDecode, compile_wanted

SAMPLED = dict(temperature=0.7, top_k=20, top_p=0.9)  # three warpers before TokenSampler
# fp32 log-probs of the same tokens, eager (dynamic cache) against compiled (static cache,
# inductor's fused kernels): the same math with reductions in another order and attention over
# masked cache slots; measured worst case 4.8e-7 for both models, before and after the weight update
# (pytest -s prints it), so 1e-5 is 20x that and still far below what a stale weight (0.05 x randn
# added to every weight) or another token changes.
LOGPROB_TOL = dict(rtol=1e-5, atol=1e-5)


def _tiny():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=4, seed=0).eval()
    prompts = [tok.encode(f"{a}+{b}=") for a in (1, 22, 333) for b in (4, 55)]
    return model, tok.pad_token_id, tok.eos_token_id, prompts


def _qwen2():
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
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1000, (9 - i % 3,), generator=g).tolist() for i in range(4)]
    return model, 0, 1, prompts


class _Spy:
    """torch.compile that counts the compiled forward's calls (the decode steps that went through
    it)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, fn, **kwargs):
        compiled = self.real(fn, **kwargs)

        def counted(*args, **kw):
            self.calls += 1
            return compiled(*args, **kw)

        return counted


def _assert_same(a, b):
    assert a.response_ids == b.response_ids
    assert a.finish_reason == b.finish_reason
    for x, y in zip(a.sampler_logprobs, b.sampler_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), **LOGPROB_TOL)
    worst = max(
        abs(u - v)
        for x, y in zip(a.sampler_logprobs, b.sampler_logprobs, strict=True)
        for u, v in zip(x, y, strict=True)
    )
    # pytest -s shows it: the measured case of LOGPROB_TOL
    print(f"worst |log-prob difference|: {worst:.2e}")


def test_compile_wanted():
    assert compile_wanted("auto", "cuda") and not compile_wanted("auto", "cpu")
    assert compile_wanted("on", "cpu") and not compile_wanted("off", "cuda")
    with pytest.raises(ValueError, match="hf_compile"):
        compile_wanted("yes", "cpu")


def test_the_static_cache_is_as_large_as_the_memory_estimate_counts():
    """CompiledDecode's cache for 5 rows on 7-token prompts with 250 new tokens: 256 positions, and
    its tensors once a forward has filled them (transformers allocates them then) weigh what
    grpo_ds.model.memory counts."""
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Qwen2ForCausalLM(config)
    kwargs = CompiledDecode("cpu", 60.0).generate_kwargs(model, 5, 6, 250)
    cache = next(v for k, v in kwargs.items() if k != "compile_config")
    with torch.no_grad():
        model(
            input_ids=torch.randint(0, 128, (5, 7)),
            **{k: v for k, v in kwargs.items() if k != "compile_config"},
            use_cache=True,
        )
    held = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    shape = ModelShape(
        params=1,
        trainable=1,
        split=0,
        largest_layer=1,
        hidden=64,
        layers=3,
        intermediate=128,
        heads=4,
        kv_heads=2,
        vocab=128,
    )
    assert held == memory._kv_cache(shape, 4, 5, 256) == 5 * 256 * 3 * 2 * 2 * 16 * 4


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_the_recipe_key_reaches_the_engine(setting):
    """rollout.hf_compile and its timeout, as the run builds the hf engine on a CPU ("auto": eager
    there)."""
    recipe = load_recipe(
        str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.json"),
        [f"rollout.hf_compile={setting}", "rollout.hf_compile_timeout_s=42"],
    )
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=4, seed=0)
    engine = session_module._rollout_engine(
        SimpleNamespace(recipe=recipe, tokenizer=tok, env_factory=None),
        SimpleNamespace(device=torch.device("cpu")),
        shared_module=model,
    )
    if setting == "on":
        assert isinstance(engine.compiled, CompiledDecode) and engine.compiled.timeout_s == 42
    else:
        assert engine.compiled is None


@pytest.mark.parametrize("build", [_tiny, _qwen2], ids=["tiny_llama", "qwen2"])
def test_compiled_decoding_samples_what_eager_samples(build, monkeypatch):
    """Sampled (three warpers) and greedy, then again after a weight update: the same tokens, the
    same log-probs to fp32 rounding; every decode step after the first call's prefill ran through
    the compiled forward."""
    model, pad, eos, prompts = build()
    eager = HFRolloutEngine(copy.deepcopy(model), pad, eos, batch_prompts=64)
    spy = _Spy(torch.compile)
    monkeypatch.setattr(torch, "compile", spy)
    said = []
    compiled = HFRolloutEngine(
        model,
        pad,
        eos,
        batch_prompts=64,
        compiled=CompiledDecode("cpu", timeout_s=600, say=said.append),
    )
    new_tokens = 6
    for sampling in (
        SamplingParams(max_new_tokens=new_tokens, seed=5, **SAMPLED),
        SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
    ):
        _assert_same(compiled.generate(prompts, 2, sampling), eager.generate(prompts, 2, sampling))
    decode = compiled.compiled
    assert said == [] and decode.failed is None
    # each call: one eager prefill, then the decode steps compiled
    assert spy.calls == 2 * (new_tokens - 1)
    # one static cache for the 2 x len(prompts) rows, its length rounded up, kept for the next call
    # (same addresses)
    assert list(decode.caches) == [2 * len(prompts)] and decode.cache_len == 256
    cache = decode.caches[2 * len(prompts)]
    keys = cache.layers[0].keys.data_ptr()
    # weights synced in place after an optimizer step reach the compiled graph (its parameters are
    # inputs)
    g = torch.Generator().manual_seed(2)
    update = [
        (name, p + 0.05 * torch.randn(p.shape, generator=g)) for name, p in model.named_parameters()
    ]
    assert compiled.update_weights(iter(update)) == eager.update_weights(iter(update))
    sampling = SamplingParams(max_new_tokens=new_tokens, seed=9, **SAMPLED)
    _assert_same(compiled.generate(prompts, 2, sampling), eager.generate(prompts, 2, sampling))
    assert spy.calls == 3 * (new_tokens - 1) and decode.failed is None
    assert decode.caches[2 * len(prompts)] is cache and cache.layers[0].keys.data_ptr() == keys


def _fallback(monkeypatch, compiled_forward, timeout_s):
    """The tiny engine with torch.compile replaced by one returning ``compiled_forward``: (compiled
    result, eager result, seconds the compiled engine's first call took, what it said, the
    CompiledDecode, compile calls)."""
    model, pad, eos, prompts = _tiny()
    eager = HFRolloutEngine(copy.deepcopy(model), pad, eos, batch_prompts=64)
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or compiled_forward)
    said = []
    decode = CompiledDecode("cpu", timeout_s=timeout_s, say=said.append, poll_s=0.05)
    engine = HFRolloutEngine(model, pad, eos, batch_prompts=64, compiled=decode)
    sampling = SamplingParams(max_new_tokens=5, seed=3, **SAMPLED)
    start = time.monotonic()
    got = engine.generate(prompts, 2, sampling)
    took = time.monotonic() - start
    _assert_same(got, eager.generate(prompts, 2, sampling))
    # later calls generate eagerly without trying again
    again = engine.generate(prompts, 2, sampling)
    assert again.response_ids == got.response_ids and len(compiles) == 1 and len(said) == 1
    return took, said[0], decode


def test_a_compile_that_hangs_falls_back_to_eager_within_the_bound(monkeypatch):
    release = threading.Event()

    def hangs(*args, **kwargs):  # the first decode step's compile never returns
        release.wait()
        raise RuntimeError("released at the end of the test")

    try:
        took, said, decode = _fallback(monkeypatch, hangs, timeout_s=1.0)
        assert took < 1.0 + 20  # the bound, plus the eager generation on a busy 2-core machine
        assert "made no progress for 1 s after 1 tokens" in said and "generating eagerly" in said
        # left blocked; it never keeps the process alive
        assert decode._worker.is_alive() and decode._worker.daemon
    finally:
        release.set()
    decode._worker.join(timeout=10)
    # woken up, it dropped its call and ended: it was sent no more
    assert not decode._worker.is_alive()


def test_a_compile_that_raises_falls_back_to_eager(monkeypatch):
    def raises(*args, **kwargs):
        raise RuntimeError("inductor: C++ compile failed\nlong log ...")

    took, said, decode = _fallback(monkeypatch, raises, timeout_s=60)
    assert took < 20  # at once, not after the bound
    assert said == (
        "warning: rollout.hf_compile: compiled decoding failed: RuntimeError: inductor: C++ "
        "compile failed; generating eagerly from now on"
    )
    assert decode.failed.startswith("failed: RuntimeError")
