"""Turn the recipe's ``rollout.env`` and ``rollout.env_options`` into an environment factory,
reporting every mistake as a one-line UserError before any model is loaded."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from grpo_ds.envs.base import EnvFactory
from grpo_ds.envs.calculator import CalculatorEnv
from grpo_ds.errors import UserError, first_line
from grpo_ds.rewards.loading import import_attribute

BUILTIN_ENVS: dict[str, Callable[..., Any]] = {"calculator": CalculatorEnv}


def load_env_factory(
    name: str, options: dict | None = None, where: str = "rollout.env"
) -> EnvFactory:
    """Resolve a built-in environment name or "package.module:Class" and bind ``options`` (keyword
    arguments of the class, the recipe's ``<where>_options``); one environment is built to check
    them. Every mistake is a UserError, raised before any model is loaded."""
    options = {} if options is None else options
    options_where = f"{where}_options"
    if not isinstance(options, dict):
        raise UserError(
            options_where, f"expected an object, got {type(options).__name__}", 'e.g. {"call": "?"}'
        )
    target = _resolve(where, name, BUILTIN_ENVS)
    try:
        inspect.signature(target).bind(**options)
    except TypeError as err:
        raise UserError(
            options_where,
            f"{name!r} does not take these options ({first_line(err)})",
            "use the keyword arguments of its constructor",
        ) from None
    except ValueError:  # no signature to check (some C callables): building one below still checks
        pass
    try:
        env = target(**options)
    except Exception as err:
        raise UserError(
            options_where,
            f"building {name!r} raised {type(err).__name__}: {first_line(err)}",
            "fix the option values",
        ) from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise UserError(
            where,
            f"{name!r} builds a {type(env).__name__}, which has no reset/step methods",
            "an environment has reset(row) -> str and step(model_turn) -> StepResult",
        )
    stop = getattr(env, "turn_stop", ())
    if not (isinstance(stop, tuple) and all(isinstance(s, str) and s for s in stop)):
        raise UserError(
            where, f"{name!r} has turn_stop {stop!r}", "make it a tuple of non-empty strings"
        )
    return functools.partial(target, **options) if options else target


def _resolve(where: str, name: Any, builtins: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    if not isinstance(name, str) or not name.strip():
        raise UserError(
            where,
            f"expected an environment name, got {name!r}",
            f"a built-in ({', '.join(builtins)}) or package.module:Class",
        )
    name = name.strip()
    if ":" not in name:
        if name in builtins:
            return builtins[name]
        close = difflib.get_close_matches(name, list(builtins), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(
            where,
            f"unknown built-in environment {name!r}",
            f"{hint}Built-ins are: {', '.join(builtins)}; or give your own as package.module:Class",
        )
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UserError(
            where, f"{name!r} is not of the form package.module:Class", 'e.g. "my_envs:Maze"'
        )
    target = import_attribute(where, module_name, attr, "class", brief=first_line)
    if not callable(target):
        raise UserError(
            where,
            f"{name!r} is a {type(target).__name__}, not a class or function",
            "point at an environment class (or a function returning a new environment)",
        )
    return target
