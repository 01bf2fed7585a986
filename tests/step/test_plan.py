"""The planner on random length distributions: coverage, equal counts, token cap, balance."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_ds.config.loading import load_recipe
from grpo_ds.errors import UserError
from grpo_ds.step.plan import (
    old_logprob_pass_reason,
    pack_micro_batches,
    plan_minibatch,
    plan_recipe_step,
    plan_step,
    shard_by_tokens,
    split_minibatches,
)

lengths_st = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, world=st.integers(1, 9), micro=st.integers(1, 7))
def test_static_plan_covers_every_sample_once_with_equal_counts(lengths, world, micro):
    tokens = dict(enumerate(lengths))
    plan = plan_minibatch(list(tokens), tokens, world, max_samples=micro)
    assert len(plan.micro_batches) == world
    counts = {len(rank) for rank in plan.micro_batches}
    assert len(counts) == 1  # ZeRO-3 needs every rank to run the same number of micro-batches
    used = sorted(s for rank in plan.micro_batches for mb in rank for s in mb)
    assert used == sorted(tokens)
    assert all(len(mb) <= micro for rank in plan.micro_batches for mb in rank)
    # sample counts per rank differ by at most one -> the fewest micro-batches any layout can have
    per_rank = [sum(len(mb) for mb in rank) for rank in plan.micro_batches]
    assert max(per_rank) - min(per_rank) <= 1
    assert plan.micro_batches_per_rank == max(1, math.ceil(math.ceil(len(lengths) / world) / micro))


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, world=st.integers(1, 9), cap_extra=st.integers(0, 600))
def test_dynamic_plan_respects_token_cap(lengths, world, cap_extra):
    tokens = dict(enumerate(lengths))
    cap = max(lengths) + cap_extra
    plan = plan_minibatch(list(tokens), tokens, world, max_tokens=cap)
    assert len({len(rank) for rank in plan.micro_batches}) == 1
    used = sorted(s for rank in plan.micro_batches for mb in rank for s in mb)
    assert used == sorted(tokens)
    for rank in plan.micro_batches:
        for mb in rank:
            if mb:
                # padded tokens never exceed the cap
                assert len(mb) * max(tokens[s] for s in mb) <= cap


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, world=st.integers(1, 9))
def test_token_balance_is_within_one_sequence(lengths, world):
    """Greedy longest-first: the heaviest rank exceeds the lightest by at most the longest
    sequence."""
    tokens = dict(enumerate(lengths))
    shards = shard_by_tokens(list(tokens), tokens, world)
    loads = [sum(tokens[s] for s in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(lengths)


def test_balancing_beats_round_robin_on_skewed_lengths():
    lengths = [100, 100, 1, 1, 1, 1, 100, 100]
    tokens = dict(enumerate(lengths))
    shards = shard_by_tokens(list(tokens), tokens, 2, balance_counts=True)
    assert sorted(sum(tokens[s] for s in shard) for shard in shards) == [202, 202]


def test_padding_micro_batches_fill_short_ranks():
    tokens = dict(enumerate([5] * 9))
    plan = plan_minibatch(list(tokens), tokens, 2, max_samples=2)
    # 5 + 4 samples -> 3 and 2 micro-batches -> the second rank gets one padding micro-batch
    assert plan.micro_batches_per_rank == 3
    assert plan.padding_micro_batches() == 1
    assert () in plan.micro_batches[1]


def test_more_ranks_than_samples():
    tokens = dict(enumerate([3, 4]))
    plan = plan_minibatch(list(tokens), tokens, 5, max_samples=4)
    assert plan.micro_batches_per_rank == 1
    assert plan.padding_micro_batches() == 3


def test_sequence_longer_than_cap_is_a_plan_time_error():
    with pytest.raises(UserError) as err:
        pack_micro_batches([0, 1], {0: 10, 1: 50}, max_tokens=40)
    assert err.value.where == "train.max_tokens_per_micro_batch"
    assert "50" in err.value.what and "40" in err.value.what


@given(n=st.integers(1, 40), epochs=st.integers(1, 3), data=st.data())
def test_minibatches_use_every_sample_once_per_epoch(n, epochs, data):
    size = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    batches = split_minibatches(n, size, epochs, seed=3)
    assert len(batches) == n // size * epochs
    per_epoch = n // size
    for e in range(epochs):
        assert sorted(s for b in batches[e * per_epoch : (e + 1) * per_epoch] for s in b) == list(
            range(n)
        )


@pytest.mark.parametrize(
    ("overrides", "runs"),
    [
        ({}, False),
        ({"train": {"samples_per_optimizer_step": 8}}, True),  # two optimizer steps per rollout
        ({"train": {"epochs_per_rollout": 2}}, True),
        # importance weights need pi_old at sampling time
        ({"algorithm": {"rollout_is_cap": 2.0}}, True),
        ({"algorithm": {"kl_coef": 0.1, "kl_in_reward": True}}, True),
        ({"algorithm": {"kl_coef": 0.1}}, False),  # KL in the loss needs the reference pass only
    ],
)
def test_old_logprob_pass_is_decided_once_and_recorded_in_the_plan(overrides, runs):
    recipe = load_recipe({"rollout": {"prompts_per_step": 4, "group_size": 4}, **overrides})
    assert (old_logprob_pass_reason(recipe) is not None) == runs
    plan = plan_recipe_step(recipe, [5] * 16, 2, step=1)
    assert plan.old_logprob_pass == runs
    assert len(plan.minibatches) == recipe.optimizer_steps_per_rollout


def test_each_phase_gets_its_own_micro_size():
    plan = plan_step(
        [5] * 16,
        1,
        samples_per_minibatch=16,
        epochs=1,
        update_micro_samples=2,
        logprob_micro_samples=8,
        max_tokens=None,
        seed=0,
        old_logprob_pass=False,
    )
    assert {len(mb) for mb in plan.minibatches[0].micro_batches[0]} == {2}
    assert {len(mb) for mb in plan.logprob_pass.micro_batches[0]} == {8}
