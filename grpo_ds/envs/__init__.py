"""Environments for multi-turn (agent) rollouts, selected in a recipe by name (``"rollout.env": "calculator"``).

An environment follows grpo_ds.rollout.agent.Environment: ``turn_stop`` (strings that end a model turn),
``reset(row) -> str`` and ``step(model_turn) -> StepResult(observation, reward, done)``. Give your own as
``package.module:Class``; ``rollout.env_options`` are its constructor's keyword arguments.
"""

from grpo_ds.envs.calculator import CalculatorEnv

BUILTIN_ENVS = {"calculator": CalculatorEnv}

__all__ = ["BUILTIN_ENVS", "CalculatorEnv"]
