"""Turn the recipe's ``reward.functions`` specs (parsed: grpo_ds.config.reward_specs) into
callables, reporting every mistake as a UserError.

Everything here runs at recipe load time, before any model is loaded, so a misspelt name or a
module that does not import stops the run at once with one line saying what to fix.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from grpo_ds.config.reward_specs import RewardFunctionSpec
from grpo_ds.errors import UserError
from grpo_ds.rewards.builtin import BUILTIN_REWARDS

_SIGNATURE = "def my_reward(*, prompts, completions, completion_ids, **columns)"


class RewardFn(Protocol):
    """What a reward function is: called on each chunk of a step's batch (``reward.chunk_samples``),
    with keyword arguments only; returns one value per completion (a number, None for "no score", or
    a RewardError for a failed sample), or an awaitable of that list for an ``async def`` function.
    ``columns`` holds every dataset column, aligned with ``completions``."""

    def __call__(
        self,
        *,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        **columns: list,
    ) -> list | Awaitable[list]: ...


@dataclass(frozen=True)
class RewardFunction:
    """One reward term: ``weight * fn(...)`` is added to each sample's total reward."""

    name: str  # the spec's name: a built-in name or "package.module:function"
    weight: float
    fn: RewardFn


def load_reward_functions(specs: Sequence[RewardFunctionSpec]) -> list[RewardFunction]:
    """Resolve each spec's name (a built-in, or package.module:function) and check that its
    signature takes the reward keyword arguments; raise UserError at ``reward.functions[i].name``
    for the first that fails."""
    functions = []
    for i, spec in enumerate(specs):
        where = f"reward.functions[{i}].name"
        fn = _resolve(where, spec.name)
        _check_signature(where, spec.name, fn)
        functions.append(RewardFunction(name=spec.name, weight=spec.weight, fn=fn))
    return functions


def _resolve(where: str, name: str) -> Callable[..., Any]:
    if ":" not in name:
        if name in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[name]
        builtins = ", ".join(BUILTIN_REWARDS)
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(
            where,
            f"unknown built-in reward {name!r}",
            f"{hint}Built-ins are: {builtins}; or give your own as package.module:function",
        )
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UserError(
            where,
            f"{name!r} is not of the form package.module:function",
            'e.g. "my_rewards:length"',
        )
    target = import_attribute(where, module_name, attr, "function")
    if not callable(target):
        raise UserError(
            where,
            f"{name!r} is a {type(target).__name__}, not a function",
            f"point at a function: {_SIGNATURE}",
        )
    return target


def import_attribute(
    where: str,
    module_name: str,
    attr: str,
    noun: str,
    brief: Callable[[BaseException], str] | None = None,
) -> Any:
    """``module_name`` imported and ``attr`` (dotted) looked up in it; every failure is one
    UserError at ``where`` (``noun``: what the attribute should be, for the hint). Shared by reward
    functions and agent environments."""
    brief = brief or _brief
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(
            where,
            f"cannot import module {module_name!r} ({brief(err)})",
            "check the module is installed or its folder is on PYTHONPATH",
        ) from None
    except Exception as err:  # the module's own code failed while importing
        raise UserError(
            where,
            f"importing module {module_name!r} raised {type(err).__name__}: {brief(err)}",
            "fix the module so it imports cleanly (try: python -c 'import " + module_name + "')",
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = sorted(
                n
                for n in dir(module)
                if not n.startswith("_") and callable(getattr(module, n, None))
            )
            close = difflib.get_close_matches(part, public, n=1, cutoff=0.5)
            fix = (
                f"did you mean {module_name}:{close[0]}?"
                if close
                else f"check the {noun} name in the module"
            )
            raise UserError(where, f"module {module_name!r} has no attribute {attr!r}", fix)
        target = getattr(target, part)
    return target


def _check_signature(where: str, name: str, fn: Callable[..., Any]) -> None:
    """Catch at load time a function that cannot accept the documented keyword arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature: trust them
        return
    try:
        sig.bind_partial(prompts=[], completions=[], completion_ids=[])
        required_positional = [
            p.name
            for p in sig.parameters.values()
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty
        ]
        if required_positional:
            raise TypeError(f"positional-only parameter {required_positional[0]!r}")
    except TypeError as err:
        raise UserError(
            where,
            f"{name!r} cannot be called with the reward keyword arguments ({_brief(err)})",
            f"use the signature {_SIGNATURE}",
        ) from None


def _brief(err: BaseException, limit: int = 200) -> str:
    """An exception message on one short line, for a one-line UserError."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
