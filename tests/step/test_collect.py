"""Rollout + reward collection, and DAPO dynamic sampling (grpo_ds.step.collect), with a scripted
engine."""

import pytest
import torch

from grpo_ds.distributed.ranks import Dist
from grpo_ds.rollout.base import Rollouts
from grpo_ds.run.preflight import prepare_inputs
from grpo_ds.run.prompts import PromptSampler
from grpo_ds.step.collect import collect
from grpo_ds.step.context import StepContext

REWARDS = """
def is_a(*, completions, **kwargs):
    return [float(c == "a") for c in completions]
"""
DIST = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class ScriptedEngine:
    """A prompt whose ids sum to an odd number gets a mixed group ("a", "b", ...): unequal rewards.
    Others get "b" only (all rewards 0), or, with informative_odd=False, every group is flat."""

    def __init__(self, tokenizer, informative_odd=True):
        self.a, self.b = (tokenizer.encode(c, add_special_tokens=False) for c in "ab")
        self.informative_odd, self.calls = informative_odd, 0

    def generate(self, prompts, group_size, sampling, rows=None):
        self.calls += 1
        out = Rollouts([], [], [], [])
        for p in prompts:
            mixed = self.informative_odd and sum(p) % 2 == 1
            for j in range(group_size):
                ids = self.a if mixed and j % 2 == 0 else self.b
                out.prompt_ids.append(list(p))
                out.response_ids.append(list(ids))
                out.sampler_logprobs.append([-0.5] * len(ids))
                out.finish_reason.append("stop")
        return out


@pytest.fixture
def make_inputs(tmp_path, monkeypatch):
    (tmp_path / "collect_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(**overrides):
        base = {
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "reward.functions": [{"name": "collect_rewards:is_a"}],
        }
        return prepare_inputs("recipes/tiny_cpu.json", {**base, **overrides}, 1, "cpu")

    return make


def _run(inputs, engine, step=1):
    sampler = PromptSampler(len(inputs.prompts), 0, True)
    return collect(step, StepContext(inputs, DIST, rollout=engine), sampler)


def test_one_round_without_dynamic_sampling(make_inputs):
    inputs = make_inputs()
    engine = ScriptedEngine(inputs.tokenizer)
    samples = _run(inputs, engine)
    assert engine.calls == 1 and len(samples.rollouts) == 16 and len(samples.rewards) == 16
    assert not any(key.startswith("dynamic/") for key in samples.metrics)
    for g, prompt in enumerate(samples.prompt_index):  # groups line up with their prompts
        assert all(
            samples.rollouts.prompt_ids[g * 4 + j] == inputs.prompts[prompt].prompt_ids
            for j in range(4)
        )


def test_dynamic_sampling_keeps_only_informative_groups(make_inputs):
    inputs = make_inputs(
        **{"algorithm.dynamic_sampling": True, "algorithm.dynamic_sampling_max_rounds": 20}
    )
    engine = ScriptedEngine(inputs.tokenizer)
    samples = _run(inputs, engine)
    groups = [samples.rewards[g * 4 : (g + 1) * 4] for g in range(4)]
    assert all(len(set(g)) > 1 for g in groups)  # every kept group has unequal rewards
    assert len(samples.rollouts) == 16
    m = samples.metrics
    # the builtin data has even sums too: more rounds were needed
    assert m["dynamic/rounds"] == engine.calls > 1
    assert m["dynamic/prompts_drawn"] == 4 * engine.calls
    assert m["dynamic/informative_groups"] >= 4 and m["dynamic/topped_up_groups"] == 0
    # reward metrics describe every drawn sample, not just the kept ones
    assert m["reward/collect_rewards:is_a"] == pytest.approx(m["reward_mean"])
    for g, prompt in enumerate(samples.prompt_index):
        assert sum(inputs.prompts[prompt].prompt_ids) % 2 == 1
        assert samples.rollouts.prompt_ids[g * 4] == inputs.prompts[prompt].prompt_ids


def test_dynamic_sampling_is_bounded_and_tops_up(make_inputs):
    inputs = make_inputs(
        **{"algorithm.dynamic_sampling": True, "algorithm.dynamic_sampling_max_rounds": 2}
    )
    engine = ScriptedEngine(inputs.tokenizer, informative_odd=False)
    samples = _run(inputs, engine)
    assert engine.calls == 3  # one round plus the 2 extra allowed
    assert len(samples.rollouts) == 16 and samples.rewards == [0.0] * 16
    assert (
        samples.metrics["dynamic/topped_up_groups"] == 4
        and samples.metrics["dynamic/informative_groups"] == 0
    )


def test_environment_rewards_are_added(make_inputs):
    inputs = make_inputs()

    class WithEnv(ScriptedEngine):
        def generate(self, prompts, group_size, sampling, rows=None):
            out = super().generate(prompts, group_size, sampling, rows)
            out.env_rewards = [0.25] * len(out)
            return out

    samples = _run(inputs, WithEnv(inputs.tokenizer))
    scored = [float(inputs.tokenizer.decode(r) == "a") for r in samples.rollouts.response_ids]
    assert samples.rewards == [s + 0.25 for s in scored]
    assert samples.metrics["reward/env"] == 0.25


def test_no_signal_fraction_counts_the_groups_with_equal_rewards():
    from grpo_ds.step.collect import no_signal_fraction

    # groups of 4: all 1s, mixed, all 0s, mixed by a tiny amount, one reward only repeated
    rewards = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5000001]
    assert no_signal_fraction(rewards, 4) == 0.5
    # pairs: (1,1) (1,1) (0,1) (0,1) (0,0) (0,0) (.5,.5) (.5,.5000001)
    assert no_signal_fraction(rewards, 2) == 5 / 8
    assert no_signal_fraction([0.3], 1) == 1.0  # a group of one never carries a signal


def test_the_step_logs_its_no_signal_fraction(make_inputs):
    inputs = make_inputs()
    # odd-sum prompts mixed, the others all 0
    samples = _run(inputs, ScriptedEngine(inputs.tokenizer))
    flat = sum(sum(inputs.prompts[p].prompt_ids) % 2 == 0 for p in samples.prompt_index)
    assert samples.metrics["no_signal_frac"] == flat / 4
    flat_only = _run(inputs, ScriptedEngine(inputs.tokenizer, informative_odd=False))
    assert flat_only.metrics["no_signal_frac"] == 1.0
