"""The hf rollout engine: grouping, EOS handling, sampler log-probs (the same numbers as the
all-steps path it replaced, recorded after every warper), weight updates."""

from dataclasses import replace

import pytest
import torch
from transformers import GenerationConfig

from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout import hf
from grpo_ds.rollout.base import Rollouts, SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.streams import RowStreams

# temperature 1; a lower temperature with top-k and top-p (three warpers); greedy decoding
SAMPLINGS = {
    "t1": dict(temperature=1.0),
    "t0.7_topk_topp": dict(temperature=0.7, top_k=20, top_p=0.9),
    "greedy": dict(temperature=0.0),
}


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
    for ids, reason, logprobs in zip(
        out.response_ids, out.finish_reason, out.sampler_logprobs, strict=True
    ):
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
    out = engine.generate(
        [tok.encode("2+2="), tok.encode("10+4=")],
        2,
        SamplingParams(max_new_tokens=4, temperature=temperature, seed=3),
    )
    for prompt, response, logprobs in zip(
        out.prompt_ids, out.response_ids, out.sampler_logprobs, strict=True
    ):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[
                0, len(prompt) - 1 : len(prompt) + len(response) - 1
            ]
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(
            -1, torch.tensor(response)[:, None]
        )
        # the batched, left-padded generate path vs one unpadded forward: fp32 kernels in another
        # order
        torch.testing.assert_close(
            torch.tensor(logprobs), expected.squeeze(-1), rtol=1e-4, atol=1e-4
        )


def test_same_seed_same_samples_and_batching_does_not_matter():
    engine, tok = _engine()
    prompts = [tok.encode(f"{a}+{a}=") for a in range(5)]
    a = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=7))
    b = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=7))
    assert a.response_ids == b.response_ids
    c = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=8))
    assert c.response_ids != a.response_ids


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_sample_does_not_depend_on_how_the_steps_prompts_are_spread(sampling):
    """A step's prompts on one rank in one call, or cut over three ranks (first_prompt: where a
    rank's slice starts) and generated two prompts per call: the same samples with the same
    log-probs, so a run draws the same samples at any world size. Different seeds or places draw
    others."""
    engine, tok = _engine()
    prompts = [tok.encode(f"{a}+{b}=") for a in range(0, 30, 7) for b in (1, 22, 5)]
    params = SamplingParams(max_new_tokens=6, seed=11, **sampling)
    whole = engine.generate(prompts, 4, params)
    engine.batch_prompts = 2
    cuts = [0, 6, 11, len(prompts)]
    parts = Rollouts.concat(
        [
            engine.generate(prompts[lo:hi], 4, replace(params, first_prompt=lo))
            for lo, hi in zip(cuts, cuts[1:], strict=False)
        ]
    )
    assert parts.response_ids == whole.response_ids
    # fp32 logits of other padded widths: equal to rounding
    for got, expected in zip(parts.sampler_logprobs, whole.sampler_logprobs, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    if sampling["temperature"] > 0:
        # the same prompts keyed as the step's first
        moved = engine.generate(prompts[6:], 4, params)
        assert moved.response_ids != whole.response_ids[6 * 4 :]
        # a group's samples differ from each other
        assert len(set(map(tuple, whole.response_ids))) > len(prompts)


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
    for (name, mine), (_, theirs) in zip(
        engine.model.named_parameters(), donor.model.named_parameters(), strict=True
    ):
        assert torch.equal(mine, theirs), name


def test_a_shared_policy_module_generates_in_eval_mode_and_goes_on_training():
    """The policy's own module (rollout_shares_policy): generate runs it in eval mode, so activation
    checkpointing does not switch the KV cache off, and it is back in train mode afterwards; a
    weight sync is refused."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=4, seed=0).train()
    # 5.24 has it; 5.17 (the GPU machines') only the old name
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # as grpo_ds.model.loading sets it for training
    engine = HFRolloutEngine(
        model, tok.pad_token_id, tok.eos_token_id, 64, shares_policy_weights=True
    )
    modes, lengths = [], []

    def record(module, _args, kwargs):
        modes.append(module.training)
        lengths.append(kwargs["input_ids"].shape[1])

    model.register_forward_pre_hook(record, with_kwargs=True)
    out = engine.generate([tok.encode("1+1=")], 2, SamplingParams(max_new_tokens=4, seed=0))
    assert modes and not any(modes) and model.training
    # the cache is on
    assert lengths[0] == 4 and all(n == 1 for n in lengths[1 : len(out.response_ids[0])])
    # an engine on its own copy of the same weights draws the same samples
    copy, _ = _engine(seed=0)
    assert (
        copy.generate(
            [tok.encode("1+1=")], 2, SamplingParams(max_new_tokens=4, seed=0)
        ).response_ids
        == out.response_ids
    )
    with pytest.raises(RuntimeError, match="no weights to sync"):
        engine.update_weights(iter([]))


def test_truncated_sampler_logprobs_are_the_trainers_over_the_set():
    """With top-k and top-p the sampler records log-probs over the set it drew from, and the
    trainer's reference math over the same set (grpo_ds.algo.truncation) gives the same numbers: an
    importance weight of 1. Over the whole vocabulary they would differ by the log of each
    position's kept mass."""
    from grpo_ds.algo.logprobs import token_logprobs_and_entropy
    from grpo_ds.algo.truncation import Truncation

    engine, tok = _engine()
    sampling = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.7, seed=3)
    out = engine.generate([tok.encode("2+2="), tok.encode("10+4=")], 4, sampling)
    assert out.sampler_settings == [sampling.settings] * 8
    kept_mass = []
    for prompt, response, logprobs in zip(
        out.prompt_ids, out.response_ids, out.sampler_logprobs, strict=True
    ):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + response])).logits[
                0, len(prompt) - 1 : -1
            ]
        over_set, _ = token_logprobs_and_entropy(
            logits,
            torch.tensor(response),
            temperature=0.7,
            truncation=Truncation(top_k=5, top_p=0.7),
        )
        whole, _ = token_logprobs_and_entropy(logits, torch.tensor(response), temperature=0.7)
        # padded vs unpadded
        torch.testing.assert_close(torch.tensor(logprobs), over_set, rtol=0, atol=1e-4)
        kept_mass.append((whole - over_set).exp())
    # five of ~100 near-uniform tokens: the whole vocabulary is far off
    assert torch.cat(kept_mass).max() < 0.5


def test_samples_carry_their_settings_and_a_trainer_refuses_others():
    from grpo_ds.errors import UserError
    from grpo_ds.rollout.base import SamplerSettings

    drawn = SamplerSettings(0.7, 5, 0.7)
    a = Rollouts([[1]], [[2, 3]], [[-0.1, -0.2]], ["stop"]).drawn_with(drawn)
    b = Rollouts([[4], [6]], [[5], [7]], [[-0.3], [-0.4]], ["length", "stop"]).drawn_with(drawn)
    both = Rollouts.concat([a, Rollouts([], [], [], []), b])
    assert (
        both.sampler_settings == [drawn] * 3 and both.select([2, 0]).sampler_settings == [drawn] * 2
    )
    # a checkpoint's in-flight record (dataclasses.asdict) comes back as the same samples
    import dataclasses

    assert Rollouts.from_record(dataclasses.asdict(both)) == both
    assert (
        Rollouts.from_record(
            {**dataclasses.asdict(both), "sampler_settings": None}
        ).sampler_settings
        is None
    )
    both.check_drawn_with(drawn, "step 3")  # the trainer's own settings: accepted
    with pytest.raises(UserError) as refused:
        both.check_drawn_with(SamplerSettings(0.7, 0, 0.7), "step 3")
    message = str(refused.value)
    assert (
        message.startswith(
            "step 3: samples drawn with temperature 0.7, top_k 5, top_p 0.7 reached a trainer that "
            "replays temperature 0.7, top_k 0, top_p 0.7"
        )
        and "\n" not in message
    )
    Rollouts.concat([a, Rollouts([[9]], [[8]], [[-0.5]], ["stop"])]).check_drawn_with(
        drawn, "unrecorded: accepted"
    )


def test_concat_keeps_order():
    a = Rollouts([[1]], [[2, 3]], [[-0.1, -0.2]], ["stop"])
    b = Rollouts([[4]], [[5]], [[-0.3]], ["length"])
    both = Rollouts.concat([a, b])
    assert both.prompt_ids == [[1], [4]] and both.finish_reason == ["stop", "length"]


def test_generation_uses_the_kv_cache_even_when_training_turned_it_off():
    engine, tok = _engine()
    engine.model.config.use_cache = False  # what gradient checkpointing sets on the policy's config
    lengths = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    engine.generate([tok.encode("1+1=")], 1, SamplingParams(max_new_tokens=4, seed=0))
    # with a cache, later steps feed one token
    assert lengths[0] == 4 and all(n == 1 for n in lengths[1:])


def all_steps_generate_left_padded(
    model,
    contexts,
    sampling,
    max_new_tokens,
    num_return_sequences,
    pad_token_id,
    eos_token_id,
    row_keys,
    stopping_criteria=None,
    compiled=None,
):
    """The reference: generate keeps every step's logits (output_logits, T tensors of (B, V)), and
    the log-probs are a float32 log-softmax of each after the same warpers, stacked, gathered at the
    new tokens (the path grpo_ds took up to commit 8643ce6). Its tokens are picked as grpo_ds picks
    them (a TokenSampler after the warpers: the same random numbers in the same order), and what
    that sampler records is not used. Same signature as the one-step recorder it must equal (eager
    only: ``compiled`` must be None)."""
    assert compiled is None, "the all-steps reference generates eagerly"
    warpers = hf.LogitsProcessorList(hf.sampling_warpers(sampling))
    pick = hf.TokenSampler(
        None if sampling.temperature <= 0 else hf.RowStreams(sampling.seed, row_keys)
    )

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
    )
    input_ids, attention_mask = hf.left_padded(
        [c for c in contexts for _ in range(num_return_sequences)], pad_token_id
    )
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        logits_processor=hf.LogitsProcessorList([*warpers, pick]),
        stopping_criteria=stopping_criteria,
    )
    new_tokens = out.sequences[:, input_ids.shape[1] :].cpu()
    logprobs = torch.stack(
        [torch.log_softmax(warpers(input_ids, s.float()), dim=-1) for s in out.logits], 1
    ).cpu()
    return new_tokens, logprobs.gather(
        -1, new_tokens[:, : logprobs.shape[1]].unsqueeze(-1)
    ).squeeze(-1)


def favour_eos(model, eos_token_id, bias=2.0, every=3):
    """Raise the EOS logit after tokens that are multiples of ``every``, so that some sequences of a
    batch end early and the others keep going, also under greedy decoding: in HF's loop the finished
    rows then receive pad tokens while the rest still sample."""

    def hook(module, args, kwargs, output):
        last = kwargs["input_ids"][:, -1]  # (B,) the token fed last
        output.logits[:, -1, eos_token_id] += bias * (last % every == 0)
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return model


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_sampler_logprobs_equal_the_all_steps_path_bitwise(sampling, monkeypatch):
    """One step's log-probs at a time gives exactly the numbers of keeping every step's logits: the
    same tokens (the same draws) and bitwise the same log-probs (the same log-softmax of the same
    warped scores), with EOS in the middle of some sequences and prompts of different lengths (left
    padding)."""
    engine, tok = _engine()
    favour_eos(engine.model, tok.eos_token_id)
    prompts = [tok.encode(f"{a}+{b}=") for a in range(0, 30, 7) for b in (1, 22, 5, 9)]
    group = 2
    params = SamplingParams(max_new_tokens=8, seed=4, **sampling)
    ours = engine.generate(prompts, group, params)
    monkeypatch.setattr(hf, "generate_left_padded", all_steps_generate_left_padded)
    reference = engine.generate(prompts, group, params)
    assert (
        ours.response_ids == reference.response_ids
        and ours.finish_reason == reference.finish_reason
    )
    assert ours.sampler_logprobs == reference.sampler_logprobs  # float lists: bitwise
    lengths = [len(r) for r in ours.response_ids]
    assert (
        "stop" in ours.finish_reason
        and "length" in ours.finish_reason
        and min(lengths) < max(lengths)
    )
    assert all(lp <= 0.0 for row in ours.sampler_logprobs for lp in row)
    # greedy: the sampled token is the argmax, not a sure thing under softmax
    if sampling["temperature"] == 0:
        assert all(lp < 0.0 for row in ours.sampler_logprobs for lp in row)


def test_sampler_logprobs_are_recorded_after_every_warper():
    """transformers puts a caller's logits processors before its own warpers (GenerationMixin
    ._get_logits_processor), so the engine passes temperature, top-k and top-p itself, before the
    recorder. With top_k=1 the distribution sampled from is one token, so every log-prob is exactly
    0; a recorder placed before top-k would see the whole vocabulary."""
    engine, tok = _engine()
    out = engine.generate(
        [tok.encode("1+2="), tok.encode("30+41=")],
        3,
        SamplingParams(max_new_tokens=6, temperature=0.7, top_k=1, top_p=0.9, seed=0),
    )
    assert all(lp == 0.0 for row in out.sampler_logprobs for lp in row)
    recorded = []
    warped = hf.LogitsProcessorList(
        [
            *hf.sampling_warpers(SamplingParams(8, temperature=0.5, top_k=5, top_p=0.8)),
            _Spy(recorded),
        ]
    )
    logits = torch.randn(3, 40)
    warped(torch.zeros(3, 1, dtype=torch.long), logits)
    # the scores the last processor sees: temperature first, then the 5 best, then the nucleus
    assert torch.isfinite(recorded[0]).sum(-1).le(5).all()
    kept = torch.isfinite(recorded[0])
    torch.testing.assert_close(recorded[0][kept], (logits / 0.5)[kept], rtol=0, atol=0)


class _Spy(hf.LogitsProcessor):
    def __init__(self, seen):
        self.seen = seen

    def __call__(self, input_ids, scores):
        self.seen.append(scores.clone())
        return scores


def test_a_warper_in_the_model_generation_config_is_refused_in_one_line():
    engine, tok = _engine()
    engine.model.generation_config.min_p = 0.05  # generate would apply it after the recorder
    with pytest.raises(ValueError, match="generation_config sets min_p=0.05"):
        engine.generate([tok.encode("1+2=")], 2, SamplingParams(max_new_tokens=2, seed=0))
    out = engine.generate(
        [tok.encode("1+2=")], 1, SamplingParams(max_new_tokens=2, temperature=0.0)
    )
    assert len(out) == 1  # greedy decoding uses no warper


@pytest.mark.parametrize("step", [0, 1, 1000])
def test_sample_tokens_draws_from_the_softmax_and_never_a_masked_token(step):
    """Inverse transform sampling with the rows' streams is exact: over 200,000 rows each token's
    frequency is its probability within 5 standard errors, a token at -inf (a warper's mask) is
    never drawn, and the same seed and keys draw the same tokens."""
    scores = torch.tensor([2.0, -torch.inf, 0.5, -1.0, 1.0, -torch.inf, -3.0])
    probs = torch.softmax(scores, -1)
    rows = 200_000
    logprobs = torch.log_softmax(scores, -1).expand(rows, -1)
    streams = RowStreams(1, range(rows))
    drawn = hf.sample_tokens(logprobs, streams.uniform(step))
    assert drawn.shape == (rows, 1)
    freq = torch.bincount(drawn.squeeze(1), minlength=len(scores)).double() / rows
    se = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * se + 1e-12).all(), (freq, probs)
    assert freq[1] == 0 and freq[5] == 0
    assert torch.equal(hf.sample_tokens(logprobs, RowStreams(1, range(rows)).uniform(step)), drawn)


def test_a_sure_token_is_always_drawn_even_with_a_tiny_vocabulary_tail():
    logprobs = torch.log_softmax(
        torch.tensor([[0.0, -200.0, -300.0], [-300.0, -200.0, 0.0]]), -1
    ).repeat(1000, 1)
    drawn = hf.sample_tokens(logprobs, RowStreams(0, range(len(logprobs))).uniform(0)).squeeze(1)
    assert drawn[0::2].eq(0).all() and drawn[1::2].eq(2).all()
