"""Continuous generation on the hf engine (grpo_ds/rollout/hf_continuous.py): a running batch
refilled as groups end draws the same samples as the batch-by-batch engine, whatever runs beside
them; new weights loaded mid-sample leave each token with the version it was sampled with and the
log-prob of that version's distribution, which the importance weights then use."""

from dataclasses import replace

import pytest
import torch

from grpo_ds.algo.importance import truncated_importance_weights
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout.base import SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.hf_continuous import ContinuousDecoder, GroupRequest
from tests.rollout.test_hf import SAMPLINGS, favour_eos

G = 4
PROMPTS = ["2+2=", "10+4=", "7*3=", "a", "hello there, ", "1", "99-9=", "xyz"]


def _model(seed=0):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=4, seed=seed)
    # some rows end early, others run to the limit: the refill has something to do
    return favour_eos(model, tok.eos_token_id), tok


def _decode_all(decoder, requests):
    """Admit ``requests`` in order whenever a group fits, step until all have ended; the finished
    groups by (step, group)."""
    pending, done = list(requests), {}
    most_running = 0
    while pending or decoder.rows_in_flight:
        while pending and decoder.free_rows >= pending[0].size:
            decoder.admit(pending.pop(0))
        most_running = max(most_running, decoder.rows_in_flight)
        for group in decoder.step():
            done[(group.step, group.group)] = group.rollouts
    return done, most_running


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_refilled_running_batch_draws_the_batch_by_batch_engines_samples(sampling):
    model, tok = _model()
    engine = HFRolloutEngine(model, tok.pad_token_id, tok.eos_token_id, batch_prompts=64)
    prompts = [tok.encode(p) for p in PROMPTS]
    steps = {1: SamplingParams(12, seed=11, **sampling), 2: SamplingParams(12, seed=12, **sampling)}
    expected = {step: engine.generate(prompts, G, params) for step, params in steps.items()}
    # room for 2 of the 16 groups at a time, the two steps' groups interleaved
    decoder = ContinuousDecoder(model, tok.pad_token_id, engine.stop_ids, capacity_rows=2 * G)
    requests = [
        GroupRequest(step, g, prompts[g], G, replace(steps[step], first_prompt=g))
        for g in range(len(prompts))
        for step in steps
    ]
    got, most_running = _decode_all(decoder, requests)
    assert most_running == 2 * G
    lengths = set()
    for step, batch in expected.items():
        for g in range(len(prompts)):
            group = got[(step, g)]
            rows = range(g * G, (g + 1) * G)
            assert group.response_ids == [batch.response_ids[i] for i in rows]
            assert group.finish_reason == [batch.finish_reason[i] for i in rows]
            assert group.sampler_settings == [batch.sampler_settings[i] for i in rows]
            assert group.token_versions == [[0] * len(r) for r in group.response_ids]
            for i, logprobs in zip(rows, group.sampler_logprobs, strict=True):
                torch.testing.assert_close(
                    torch.tensor(logprobs),
                    torch.tensor(batch.sampler_logprobs[i]),
                    atol=2e-5,
                    rtol=0,
                )
            lengths |= {len(r) for r in group.response_ids}
    assert len(lengths) > 3, lengths  # the rows did end at different times
    assert decoder.take_stats()[0] > 0 and decoder.rows_in_flight == 0


def _teacher_forced(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    picked = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / temperature
    return torch.log_softmax(picked, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_weights_loaded_mid_sample_leave_per_token_versions_and_log_probs():
    tok = build_tiny_tokenizer()
    old = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=4, seed=0)
    new = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=4, seed=1)
    decoder = ContinuousDecoder(
        build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=4, seed=0),
        tok.pad_token_id,
        [tok.eos_token_id],
        capacity_rows=2 * G,
        version=3,
    )
    sampling = SamplingParams(16, temperature=1.0, seed=5)
    prompt = tok.encode("2+2=")
    decoder.admit(GroupRequest(7, 0, prompt, G, sampling))
    done = []
    for _ in range(5):
        done += decoder.step()
    # version 4 arrives between two decode steps; nothing in flight ends or is dropped
    loaded = decoder.load_weights(new.named_parameters(), version=4)
    assert loaded == len(list(new.parameters()))
    assert decoder.rows_in_flight == G - sum(len(d.rollouts) for d in done)
    while decoder.rows_in_flight:
        done += decoder.step()
    rollouts = done[0].rollouts if len(done) == 1 else None
    assert rollouts is not None and len(rollouts) == G
    spanning = [
        i for i, versions in enumerate(rollouts.token_versions) if versions[0] != versions[-1]
    ]
    assert spanning, rollouts.token_versions  # a sample whose tokens span two versions
    for i in spanning:
        versions, response = rollouts.token_versions[i], rollouts.response_ids[i]
        assert versions == [3] * 5 + [4] * (len(response) - 5)
        sampler = torch.tensor(rollouts.sampler_logprobs[i])
        under = {3: _teacher_forced(old, prompt, response, 1.0)}
        under[4] = _teacher_forced(new, prompt, response, 1.0)
        # each token's log-prob is its own version's, the whole prefix recomputed under it
        for v, logprobs in under.items():
            mine = torch.tensor([x == v for x in versions])
            torch.testing.assert_close(sampler[mine], logprobs[mine], atol=2e-5, rtol=0)
        # the trainer, holding version 4, weights the tokens sampled under it by exactly 1 and the
        # older ones by pi_4 / pi_3
        weights = truncated_importance_weights(under[4], sampler, cap=1e6)
        torch.testing.assert_close(weights[5:], torch.ones(len(response) - 5), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            weights[:5], (under[4][:5] - under[3][:5]).exp(), rtol=1e-4, atol=0
        )
        assert not torch.allclose(weights[:5], torch.ones(5), atol=1e-3)


def test_a_group_that_does_not_fit_is_refused():
    model, tok = _model()
    decoder = ContinuousDecoder(model, tok.pad_token_id, [tok.eos_token_id], capacity_rows=G)
    decoder.admit(GroupRequest(1, 0, tok.encode("a"), G, SamplingParams(4, seed=1)))
    with pytest.raises(ValueError, match="admitted"):
        decoder.admit(GroupRequest(1, 1, tok.encode("b"), G, SamplingParams(4, seed=1)))
