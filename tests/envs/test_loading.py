"""load_env_factory: built-in environments by name, package.module:Class with options, and a
one-line UserError for every mistake."""

import functools

import pytest

from grpo_ds.envs import CalculatorEnv, StepResult, load_env_factory
from grpo_ds.errors import UserError


def load_error(name, options=None) -> UserError:
    with pytest.raises(UserError) as info:
        load_env_factory(name, options)
    return info.value


def test_builtin_env_by_name_with_and_without_options():
    assert load_env_factory("calculator") is CalculatorEnv
    factory = load_env_factory("calculator", {"call": "=", "call_reward": 0.0})
    assert isinstance(factory, functools.partial)
    env = factory()
    assert env.turn_stop == ("=",) and env.call_reward == 0.0
    assert factory() is not env  # a fresh environment per episode


def test_user_env_from_a_module(user_module):
    module = user_module(
        "my_envs",
        """
        from grpo_ds.envs import StepResult

        class Echo:
            turn_stop = ()

            def __init__(self, reward=1.0):
                self.reward = reward

            def reset(self, row):
                return ""

            def step(self, model_turn):
                return StepResult("", self.reward, True)
    """,
    )
    factory = load_env_factory(f"{module}:Echo", {"reward": 2.0})
    assert factory().step("x") == StepResult("", 2.0, True)


def test_every_loading_mistake_is_a_one_line_user_error(user_module):
    err = load_error("calculater")
    assert err.where == "rollout.env" and "did you mean 'calculator'" in str(err)
    assert "cannot import module" in str(load_error("no_such_module_xyz:Env"))
    assert "not of the form" in str(load_error("my_envs:"))
    module = user_module(
        "bad_envs",
        """
        NOT_CALLABLE = 3

        class NoStep:
            def reset(self, row):
                return ""

        class BadStop:
            turn_stop = "?"

            def reset(self, row):
                return ""

            def step(self, model_turn):
                return None

        raise_on_import = False
    """,
    )
    assert "has no attribute" in str(load_error(f"{module}:Missing"))
    assert "not a class or function" in str(load_error(f"{module}:NOT_CALLABLE"))
    assert "no reset/step" in str(load_error(f"{module}:NoStep"))
    assert "tuple of non-empty strings" in str(load_error(f"{module}:BadStop"))
    err = load_error("calculator", {"cal": "?"})
    assert err.where == "rollout.env_options" and "does not take these options" in str(err)
    err = load_error("calculator", {"call": ""})
    assert err.where == "rollout.env_options" and "call must be a non-empty string" in str(err)
    broken = user_module("broken_envs", "raise RuntimeError('boom')\n")
    assert "raised RuntimeError: boom" in str(load_error(f"{broken}:Env"))
    assert "\n" not in str(err)
