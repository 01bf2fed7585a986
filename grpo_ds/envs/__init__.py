"""Environments for multi-turn (agent) rollouts, selected in a recipe by name
(``"rollout.env": "calculator"``).

An environment follows grpo_ds.envs.base.Environment: ``turn_stop`` (strings that end a model turn),
``reset(row) -> str`` and ``step(model_turn) -> StepResult(observation, reward, done)``. Give your
own as ``package.module:Class``; ``rollout.env_options`` are its constructor's keyword arguments,
and ``load_env_factory`` (grpo_ds.envs.loading) checks both when the recipe loads. The built-in
``calculator`` environment is grpo_ds.envs.calculator.
"""

from grpo_ds.envs.base import EnvFactory, Environment, StepResult
from grpo_ds.envs.calculator import CalculatorEnv
from grpo_ds.envs.loading import BUILTIN_ENVS, load_env_factory

__all__ = [
    "BUILTIN_ENVS",
    "CalculatorEnv",
    "EnvFactory",
    "Environment",
    "StepResult",
    "load_env_factory",
]
