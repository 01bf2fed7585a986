"""rollout.placement: which launched ranks train and which generate, and the layouts refused before
anything starts (grpo_ds.config.placement.resolve_placement). Pure: recipes from dicts, no torch
work."""

import pytest

from grpo_ds.config.loading import load_recipe
from grpo_ds.config.placement import Placement, resolve_placement
from grpo_ds.errors import UserError


def recipe(**rollout):
    """A recipe with these rollout keys (and any other section given as ``section__key``)."""
    sections: dict = {"rollout": {}}
    for key, value in rollout.items():
        section, _, name = key.rpartition("__")
        sections.setdefault(section or "rollout", {})[name] = value
    return load_recipe(sections)


def refusal(world_size: int, **keys) -> UserError:
    with pytest.raises(UserError) as info:
        resolve_placement(recipe(**keys), world_size)
    assert "\n" not in str(info.value)  # one line
    return info.value


# ---------------------------------------------------------------------------------------- the roles


def test_colocated_is_the_default_and_every_rank_trains():
    p = resolve_placement(recipe(), 4)
    assert p == Placement(4, 0, 0)
    assert not p.split and p.trainer_ranks == 4
    assert [p.role(r) for r in range(4)] == ["colocated"] * 4
    assert p.describe() == "colocated: each of the 4 ranks generates its share, then trains"


def test_split_the_last_ranks_generate():
    p = resolve_placement(
        recipe(placement="split", ranks=2, max_staleness=1, algorithm__rollout_is_cap=2.0), 5
    )
    assert p == Placement(5, 2, 1)
    assert p.split and p.trainer_ranks == 3
    assert [p.role(r) for r in range(5)] == ["trainer", "trainer", "trainer", "rollout", "rollout"]
    assert (
        p.describe() == "split: ranks 0-2 train (ZeRO-3 over 3), ranks "
        "3-4 generate (2 ranks), staleness at most 1"
    )


def test_split_at_staleness_0_needs_no_importance_weights():
    # rollout.ranks defaults to 1, max_staleness to 0
    p = resolve_placement(recipe(placement="split"), 2)
    assert p == Placement(2, 1, 0) and [p.role(r) for r in range(2)] == ["trainer", "rollout"]


def test_split_ranks_must_divide_by_the_trainers_parallel_group():
    p = resolve_placement(recipe(placement="split", ranks=2, train__tensor_parallel_size=2), 4)
    assert p.trainer_ranks == 2


def test_vllm_engines_tile_the_rollout_ranks():
    p = resolve_placement(
        recipe(placement="split", engine="vllm", ranks=4, vllm_tensor_parallel_size=2), 6
    )
    assert p == Placement(6, 4, 0)


# ------------------------------------------------------------------------------------- the refusals


def test_colocated_refuses_a_staleness():
    err = refusal(2, max_staleness=1)
    assert err.where == "rollout.max_staleness" and 'needs rollout.placement "split"' in err.what


def test_split_needs_two_ranks():
    err = refusal(1, placement="split")
    assert str(err) == (
        'rollout.placement: "split" needs at least 2 ranks (one trains, one generates); this '
        "launch has 1. launch with python -m grpo_ds.launch --num_gpus 2 or more, or use "
        '"colocated".'
    )


@pytest.mark.parametrize("ranks", [2, 3])
def test_split_keeps_a_trainer_rank(ranks):
    err = refusal(2, placement="split", ranks=ranks)
    assert (
        err.where == "rollout.ranks"
        and err.what == f"{ranks} leaves no trainer rank in a world of 2"
    )
    assert err.fix == "use 1 to 1"


def test_split_refuses_trainers_the_tensor_parallel_size_does_not_divide():
    err = refusal(4, placement="split", ranks=1, train__tensor_parallel_size=2)
    assert err.where == "rollout.ranks"
    assert (
        err.what
        == "1 leaves 3 trainer ranks, which the tensor x sequence parallel size 2 does not divide"
    )
    assert err.fix == "use one of [2]"


def test_split_refuses_vllm_tensor_parallel_that_does_not_divide_the_rollout_ranks():
    err = refusal(5, placement="split", engine="vllm", ranks=3, vllm_tensor_parallel_size=2)
    assert err.where == "rollout.vllm_tensor_parallel_size"
    assert err.what == "2 does not divide rollout.ranks 3 (the rollout ranks form the vLLM engines)"
    assert err.fix == "use one of [1, 3]"


def test_staleness_needs_the_importance_sampling_correction():
    err = refusal(3, placement="split", max_staleness=1)
    assert err.where == "rollout.max_staleness" and "importance-sampling correction" in err.what
    assert "algorithm.rollout_is_cap" in err.fix
    assert resolve_placement(
        recipe(placement="split", max_staleness=1, algorithm__rollout_is_cap=2.0), 3
    ).split


def test_split_refuses_evaluation():
    err = refusal(3, placement="split", eval__data="builtin:arith")
    assert err.where == "eval.data" and 'does not run under rollout.placement "split"' in err.what


def test_split_refuses_vllm_sleep_mode():
    err = refusal(3, placement="split", engine="vllm", vllm_sleep_mode=True)
    assert err.where == "rollout.vllm_sleep_mode" and err.fix == "set it to false"
    # the hf engine ignores the key, so it is no reason to refuse
    assert resolve_placement(recipe(placement="split", vllm_sleep_mode=True), 3).split


# ------------------------------------------------------------------------- continuous generation


def test_continuous_generation_needs_split_placement():
    err = refusal(2, continuous=True)
    assert err.where == "rollout.continuous" and "split" in err.what


@pytest.mark.parametrize(
    "keys, names",
    [
        ({"engine": "agent", "env": "calculator"}, "hf and vllm engines"),
        (
            {"engine": "vllm", "ranks": 2, "vllm_tensor_parallel_size": 2},
            "one vLLM engine per rollout rank",
        ),
        ({"ranks": 2, "prompts_per_step": 1}, "fewer than rollout.ranks 2"),
        ({"algorithm__dynamic_sampling": True}, "dynamic_sampling"),
    ],
)
def test_continuous_generation_refuses_what_it_does_not_run_with_yet(keys, names):
    err = refusal(3, placement="split", continuous=True, **keys)
    assert err.where == "rollout.continuous" and names in str(err), str(err)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_continuous_generation_on_one_rollout_rank_or_several_is_accepted(engine):
    p = resolve_placement(recipe(placement="split", continuous=True, engine=engine), 2)
    assert p == Placement(2, 1, 0)
    several = recipe(placement="split", continuous=True, engine=engine, ranks=2)
    assert resolve_placement(several, 3) == Placement(3, 2, 0)
