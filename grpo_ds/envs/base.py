"""The environment protocol of multi-turn (agent) rollouts: what an environment is and what one step
returns.

The agent rollout engine (grpo_ds.rollout.agent) drives environments through this protocol; the
built-ins (grpo_ds.envs) and user environments (``package.module:Class``) implement it. It imports
nothing of grpo_ds, so environments never depend on the engine that runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepResult:
    observation: str  # text shown to the model before its next turn ("" for none)
    reward: float  # this step's reward; a sample's env reward is the sum over its steps
    done: bool  # the episode is over (e.g. the model gave its final answer)


class Environment(Protocol):
    """One episode's environment. A fresh instance is made for every sample (so it may keep state).

    ``turn_stop``: strings that end a model turn as soon as the turn's text contains one (EOS always
    ends it). ``reset(row)``: start an episode for a data row (a dict of the dataset's columns);
    return text placed after the prompt before the model's first turn (usually "").
    ``step(model_turn)``: react to the text of one model turn (decoded alone, special tokens
    skipped).
    """

    turn_stop: tuple[str, ...]

    def reset(self, row: dict) -> str: ...

    def step(self, model_turn: str) -> StepResult: ...


EnvFactory = Callable[[], Environment]  # a class, or functools.partial(cls, **options)
