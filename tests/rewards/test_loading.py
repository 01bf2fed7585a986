"""load_reward_functions: built-ins, package.module:function, and a UserError for every mistake.
The entries are parsed first, by the recipe's one parser (grpo_ds.config.reward_specs), as the
preflight does."""

import pytest

from grpo_ds.config.loading import load_recipe
from grpo_ds.config.reward_specs import RewardFunctionSpec, parse_rewards
from grpo_ds.errors import UserError
from grpo_ds.rewards import RewardFunction, load_reward_functions
from grpo_ds.rewards.builtin import exact_match, format_reward


def load(entries: list) -> list[RewardFunction]:
    """The recipe's ``reward.functions`` entries parsed and loaded, as the preflight does."""
    return load_reward_functions(parse_rewards(entries, ()).functions)


def load_error(entries: list) -> UserError:
    with pytest.raises(UserError) as info:
        load(entries)
    return info.value


def test_the_parsed_specs_load():
    (func,) = load_reward_functions([RewardFunctionSpec("format", 0.5)])
    assert func == RewardFunction("format", 0.5, format_reward)


def test_builtins_by_name_with_default_weight():
    funcs = load([{"name": "exact_match", "weight": 2}, {"name": "format"}])
    assert funcs == [
        RewardFunction("exact_match", 2.0, exact_match),
        RewardFunction("format", 1.0, format_reward),
    ]
    assert isinstance(funcs[0].weight, float)


def test_user_function_by_module_path(user_module):
    mod = user_module(
        "rw_ok_mod",
        """
        def length(*, completions, **kwargs):
            return [float(len(c)) for c in completions]
    """,
    )
    (func,) = load([{"name": f"{mod}:length", "weight": 0.5}])
    assert func.name == "rw_ok_mod:length" and func.weight == 0.5
    assert func.fn(prompts=["p"], completions=["abc"], completion_ids=[[1]]) == [3.0]


def test_async_user_function_loads(user_module):
    mod = user_module(
        "rw_async_mod",
        """
        async def judge(*, completions, **kwargs):
            return [1.0 for c in completions]
    """,
    )
    (func,) = load([{"name": f"{mod}:judge"}])
    assert func.name == "rw_async_mod:judge"


def test_async_function_with_a_bad_signature_is_caught(user_module):
    mod = user_module("rw_async_bad_mod", "async def judge(completions):\n    return []\n")
    assert "**columns" in load_error([{"name": f"{mod}:judge"}]).fix


def test_new_builtins_load_by_name():
    names = ["math_equivalence", "length_penalty", "code_exec"]
    assert [f.name for f in load([{"name": n} for n in names])] == names


def test_unknown_builtin_suggests_the_nearest():
    err = load_error([{"name": "exact_mach"}])
    assert "reward.functions[0]" in err.where
    assert "unknown built-in reward 'exact_mach'" in err.what
    assert "did you mean 'exact_match'?" in err.fix and "format" in err.fix


def test_unimportable_module(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(tmp_path))
    err = load_error([{"name": "no_such_reward_module_xyz:fn"}])
    assert "reward.functions[0]" in err.where
    assert "no_such_reward_module_xyz" in err.what and "PYTHONPATH" in err.fix


def test_missing_attribute_suggests_the_nearest(user_module):
    mod = user_module("rw_attr_mod", "def length(**kwargs):\n    return []\n")
    err = load_error([{"name": f"{mod}:lenght"}])
    assert "reward.functions[0]" in err.where and "no attribute 'lenght'" in err.what
    assert "rw_attr_mod:length" in err.fix


def test_not_callable(user_module):
    mod = user_module("rw_const_mod", "SCORE = 1.0\n")
    err = load_error([{"name": f"{mod}:SCORE"}])
    assert "reward.functions[0]" in err.where and "not a function" in err.what


def test_module_raising_on_import(user_module):
    mod = user_module("rw_boom_mod", "raise RuntimeError('config file missing')\n")
    err = load_error([{"name": f"{mod}:fn"}])
    assert "reward.functions[0]" in err.where
    assert "RuntimeError: config file missing" in err.what


def test_module_with_syntax_error(user_module):
    mod = user_module("rw_syntax_mod", "def fn(:\n")
    err = load_error([{"name": f"{mod}:fn"}])
    assert "reward.functions[0]" in err.where and "SyntaxError" in err.what


def test_signature_without_kwargs_is_caught_at_load(user_module):
    mod = user_module("rw_sig_mod", "def strict(completions, answer):\n    return []\n")
    err = load_error([{"name": f"{mod}:strict"}])
    assert "reward.functions[0]" in err.where and "prompts" in err.what and "**columns" in err.fix


def test_index_in_where_points_at_the_bad_entry():
    err = load_error([{"name": "format"}, {"name": "nope"}])
    assert err.where == "reward.functions[1].name"


@pytest.mark.parametrize(
    "spec",
    [
        {"weight": 1.0},
        "exact_match",
        {"name": "format", "weight": "1"},
        {"name": "format", "weight": float("nan")},
        {"name": "format", "wieght": 1},
    ],
)
def test_malformed_specs(spec):
    assert load_error([spec]).where.startswith("reward.functions[0]")


@pytest.mark.parametrize(
    "spec",
    [
        {"weight": 1.0},
        {"name": " "},
        {"name": "format", "weight": float("nan")},
        {"name": "format", "wieght": 1},
    ],
)
def test_recipe_validation_reads_a_spec_as_loading_does(spec):
    with pytest.raises(UserError) as info:
        load_recipe({}, {"reward.functions": [spec]})
    assert str(info.value) == str(load_error([spec]))


def test_message_is_one_line():
    err = load_error([{"name": "a.b:c"}])  # module "a" does not exist
    assert "\n" not in str(err)
