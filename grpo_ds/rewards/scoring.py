"""Score a batch with weighted reward functions, containing each function's failures.

total[i] = sum_k weight_k * score_k[i], where score_k[i] is function k's value for sample i, and
0.0 when it returned None or failed (raised, timed out, or returned a bad value). Failures are
counted per function so the metrics show them; with ``on_error="fail"`` the first one stops the run.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any

from grpo_ds.errors import UserError
from grpo_ds.rewards.loading import RewardFunction

logger = logging.getLogger("grpo_ds.rewards")

ON_ERROR_CHOICES = ("zero", "fail")

# (function key, error kind) pairs already warned about: each failure mode is logged once per process,
# not once per step, so a broken function cannot flood the log.
_WARNED: set[tuple[str, str]] = set()


class RewardFailure(RuntimeError):
    """A reward function failed and ``reward.on_error`` is ``"fail"``; the message names the function and cause."""


@dataclass
class RewardResult:
    """Scores of one batch. Keys of the dicts are the functions' names, made unique (``name``, ``name#2``)."""

    total: list[float]  # weighted sum per sample
    per_function: dict[str, list[float]]  # unweighted score per sample; None and failures are 0.0
    errors: dict[str, int] = field(default_factory=dict)  # samples scored 0.0 because the function failed
    nones: dict[str, int] = field(default_factory=dict)  # samples the function returned None for


class _Failure(Exception):
    """Internal: one function's failure, with its kind ("raised", "timeout", "bad_return", "bad_item")."""

    def __init__(self, kind: str, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.kind, self.cause = kind, cause


def unique_names(functions: list[RewardFunction]) -> list[str]:
    """The functions' names with repeats numbered: ``["exact_match", "format", "exact_match#2"]``."""
    seen: dict[str, int] = {}
    keys = []
    for f in functions:
        seen[f.name] = seen.get(f.name, 0) + 1
        keys.append(f.name if seen[f.name] == 1 else f"{f.name}#{seen[f.name]}")
    return keys


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


def check_columns(column_names) -> None:
    """Dataset columns are passed to reward functions as keywords, so none may take a reward argument's name."""
    for reserved in REWARD_ARGUMENTS:
        if reserved in column_names:
            raise UserError("data", f"the dataset has a column named {reserved!r}, which is a reward argument's name",
                            "rename that column")


def score(
    functions: list[RewardFunction],
    *,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    on_error: str,
    timeout_s: float,
) -> RewardResult:
    """Call each function once on the whole batch and combine the weighted scores.

    ``columns`` maps each dataset column to a list aligned with ``completions``. A function that
    raises or runs past ``timeout_s`` scores 0.0 on the whole batch; one that returns a list of the
    wrong length or a non-list does too; each bad item (not a number or None, or not finite) scores
    0.0 alone. With ``on_error="fail"`` any of these raises RewardFailure instead.

    The timeout runs the call in a daemon thread; Python cannot kill a thread, so a timed-out call
    is abandoned and keeps running (and holding its CPU and memory) in the background until it returns.
    """
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
    n = len(completions)
    for what, values in [("prompts", prompts), ("completion_ids", completion_ids), *columns.items()]:
        if len(values) != n:
            raise ValueError(f"{what} has {len(values)} entries for {n} completions; every input must be aligned")
    check_columns(columns)

    keys = unique_names(functions)
    total = [0.0] * n
    result = RewardResult(total=total, per_function={}, errors={}, nones={})
    for key, func in zip(keys, functions, strict=True):
        scores, errors, nones = _score_one(
            key, func, prompts, completions, completion_ids, columns, on_error, timeout_s
        )
        result.per_function[key], result.errors[key], result.nones[key] = scores, errors, nones
        for i, value in enumerate(scores):
            total[i] += func.weight * value
    return result


def _score_one(
    key: str,
    func: RewardFunction,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    on_error: str,
    timeout_s: float,
) -> tuple[list[float], int, int]:
    """One function's (scores, error count, None count), with failures contained or raised per on_error."""
    n = len(completions)
    if n == 0:
        return [], 0, 0
    # Fresh lists per call: a function that mutates its inputs (or a timed-out one still running) cannot
    # change what the next function sees.
    kwargs = {
        "prompts": list(prompts),
        "completions": list(completions),
        "completion_ids": [list(ids) for ids in completion_ids],
        **{name: list(values) for name, values in columns.items()},
    }
    try:
        values = _check_length(_call_with_timeout(key, func.fn, kwargs, timeout_s), n)
    except _Failure as failure:
        _handle(key, failure, on_error, samples=n)
        return [0.0] * n, n, 0

    scores, bad, nones = [], [], 0
    for i, value in enumerate(values):
        if value is None:
            nones += 1
            scores.append(0.0)
        elif isinstance(value, numbers.Real) and math.isfinite(float(value)):
            scores.append(float(value))
        else:
            bad.append(i)
            scores.append(0.0)
    if bad:
        first = values[bad[0]]
        failure = _Failure(
            "bad_item",
            f"returned {len(bad)} of {n} items that are not a finite number or None "
            f"(item {bad[0]} is {first!r} of type {type(first).__name__})",
        )
        _handle(key, failure, on_error, samples=len(bad))
    return scores, len(bad), nones


def _call_with_timeout(key: str, fn: Any, kwargs: dict[str, Any], timeout_s: float) -> Any:
    """Run ``fn(**kwargs)`` in a daemon thread; return its value or raise _Failure (raised / timeout)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as err:  # SystemExit too: a reward function must not end the run
            box["error"] = err

    thread = threading.Thread(target=target, name=f"reward:{key}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Failure(
            "timeout",
            f"took longer than reward.timeout_s={timeout_s:g}s (the call is abandoned and may still be running)",
        )
    if "error" in box:
        err = box["error"]
        raise _Failure("raised", f"raised {type(err).__name__}: {err}", cause=err)
    return box["value"]


def _check_length(values: Any, n: int) -> list[Any]:
    """The return value as a list of n items, or _Failure("bad_return"). Arrays and tensors are accepted."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise _Failure("bad_return", f"returned a {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise _Failure("bad_return", f"returned {len(values)} scores for {n} completions")
    return list(values)


def _handle(key: str, failure: _Failure, on_error: str, samples: int) -> None:
    """Raise RewardFailure (on_error="fail"), or warn once per (function, kind) that the samples score 0."""
    if on_error == "fail":
        raise RewardFailure(f"reward function {key!r} {failure} (reward.on_error=fail)") from failure.cause
    if (key, failure.kind) not in _WARNED:
        _WARNED.add((key, failure.kind))
        logger.warning(
            "reward function %r %s; %d sample(s) score 0.0 for it (reward.on_error=zero; this warning "
            "is shown once, the count is in the metrics)",
            key,
            failure,
            samples,
        )
