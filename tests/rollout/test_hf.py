"""The hf rollout engine: grouping, EOS handling, sampler log-probs, weight updates."""

import torch

from grpo_ds.builtin_tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout.base import Rollouts, SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine


def _engine(seed=0, batch_prompts=64):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=4, seed=seed)
    return HFRolloutEngine(model, tok.pad_token_id, tok.eos_token_id, batch_prompts), tok


def test_groups_are_consecutive_and_responses_stop_at_eos():
    engine, tok = _engine()
    prompts = [tok.encode("1+2="), tok.encode("3+41=")]
    out = engine.generate(prompts, 3, SamplingParams(max_new_tokens=5, seed=1))
    assert len(out) == 6
    assert out.prompt_ids == [prompts[0]] * 3 + [prompts[1]] * 3
    for ids, reason, logprobs in zip(out.response_ids, out.finish_reason, out.sampler_logprobs, strict=True):
        assert 1 <= len(ids) <= 5 and len(logprobs) == len(ids)
        if reason == "stop":
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
        else:
            assert reason == "length" and len(ids) == 5 and tok.eos_token_id not in ids
    mask = out.response_mask()
    assert mask.sum().item() == sum(len(r) for r in out.response_ids)


def test_sampler_logprobs_are_those_of_the_sampled_distribution():
    engine, tok = _engine()
    temperature = 0.7
    out = engine.generate([tok.encode("2+2="), tok.encode("10+4=")], 2,
                          SamplingParams(max_new_tokens=4, temperature=temperature, seed=3))
    for prompt, response, logprobs in zip(out.prompt_ids, out.response_ids, out.sampler_logprobs, strict=True):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1]
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(response)[:, None])
        # the batched, left-padded generate path vs one unpadded forward: fp32 kernels in another order
        torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(-1), rtol=1e-4, atol=1e-4)


def test_same_seed_same_samples_and_batching_does_not_matter():
    engine, tok = _engine()
    prompts = [tok.encode(f"{a}+{a}=") for a in range(5)]
    a = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=7))
    b = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=7))
    assert a.response_ids == b.response_ids
    c = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=8))
    assert c.response_ids != a.response_ids


def test_generation_batches_split_and_concatenate_in_order():
    engine, tok = _engine(batch_prompts=2)
    prompts = [tok.encode(f"{a}+1=") for a in range(5)]
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=2, seed=0))
    assert out.prompt_ids == [p for p in prompts for _ in range(2)]


def test_update_weights_copies_every_tensor():
    engine, _ = _engine(seed=0)
    donor, _ = _engine(seed=1)
    count = engine.update_weights((n, p.detach()) for n, p in donor.model.named_parameters())
    assert count == len(list(donor.model.parameters()))
    for (name, mine), (_, theirs) in zip(engine.model.named_parameters(), donor.model.named_parameters(),
                                         strict=True):
        assert torch.equal(mine, theirs), name


def test_concat_keeps_order():
    a = Rollouts([[1]], [[2, 3]], [[-0.1, -0.2]], ["stop"])
    b = Rollouts([[4]], [[5]], [[-0.3]], ["length"])
    both = Rollouts.concat([a, b])
    assert both.prompt_ids == [[1], [4]] and both.finish_reason == ["stop", "length"]


def test_generation_uses_the_kv_cache_even_when_training_turned_it_off():
    engine, tok = _engine()
    engine.model.config.use_cache = False  # what gradient checkpointing sets on the policy's config
    lengths = []
    engine.model.register_forward_pre_hook(lambda _m, _a, kw: lengths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    engine.generate([tok.encode("1+1=")], 1, SamplingParams(max_new_tokens=4, seed=0))
    assert lengths[0] == 4 and all(n == 1 for n in lengths[1:])  # with a cache, later steps feed one token
