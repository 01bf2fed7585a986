"""Score a batch with weighted reward functions (``score_functions``), containing each function's
failures, and add the reward models' scores to theirs (``add_model_scores``, the one rule that
combines the two sources).

total[i] = sum_k weight_k * score_k[i], where score_k[i] is function k's value for sample i, and
0.0 when it returned None or failed (raised, timed out, ended its worker process, returned a bad
value, or returned a ``RewardError`` for that sample). Failures are counted per function so the
metrics show them; with ``on_error="fail"`` the first one stops the run with one line.

The batch is cut into chunks of whole groups (``chunks_of``), and each function is called once per
chunk, so a score never depends on how many workers there are. The calls run in the run's worker
processes (``rewards.pool``), or, without a pool, in this process: sync functions one after another,
each in a thread with its own ``timeout_s``, and ``async def`` functions awaited together in one
event loop (in a thread of its own), each cancelled at its ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_ds.config.reward_specs import ON_ERROR_CHOICES, RewardModelSpec
from grpo_ds.errors import UserError
from grpo_ds.rewards.item_error import RewardError
from grpo_ds.rewards.loading import RewardFunction
from grpo_ds.rewards.pool import Failed, RewardPool

logger = logging.getLogger("grpo_ds.rewards")

# (function key, error kind) pairs already warned about: each failure mode is logged once per
# process, not once per step, so a broken function cannot flood the log.
_WARNED: set[tuple[str, str]] = set()


class RewardFailure(UserError):
    """A reward function failed and ``reward.on_error`` is ``"fail"``: one line (exit 2) naming the
    function and what happened."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(
            f"reward function {key!r}",
            f"{what} (reward.on_error=fail)",
            'fix the function, or set reward.on_error="zero" to score its failures 0 and go on',
        )
        self.key = key

    def __reduce__(self):  # rank 0 sends it to the other ranks
        return (RewardFailure, (self.key, self.what.removesuffix(" (reward.on_error=fail)")))


@dataclass
class RewardResult:
    """Scores of one batch. Keys of the dicts are the functions' names, made unique (``name``,
    ``name#2``)."""

    total: list[float]  # weighted sum per sample
    per_function: dict[str, list[float]]  # unweighted score per sample; None and failures are 0.0
    # samples scored 0.0 because the function failed on them
    errors: dict[str, int] = field(default_factory=dict)
    nones: dict[str, int] = field(default_factory=dict)  # samples the function returned None for


def unique_names(functions: list[RewardFunction]) -> list[str]:
    """The functions' names with repeats numbered:
    ``["exact_match", "format", "exact_match#2"]``."""
    seen: dict[str, int] = {}
    keys = []
    for f in functions:
        seen[f.name] = seen.get(f.name, 0) + 1
        keys.append(f.name if seen[f.name] == 1 else f"{f.name}#{seen[f.name]}")
    return keys


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


def check_columns(column_names) -> None:
    """Dataset columns are passed to reward functions as keywords, so none may take a reward
    argument's name."""
    for reserved in REWARD_ARGUMENTS:
        if reserved in column_names:
            raise UserError(
                "data",
                f"the dataset has a column named {reserved!r}, which is a reward argument's name",
                "rename that column",
            )


def chunks_of(n: int, chunk_samples: int | None, group_size: int = 1) -> list[tuple[int, int]]:
    """The batch's chunks as (start, end) index ranges: ``chunk_samples`` completions each, rounded
    up to whole groups of ``group_size`` (a group is never split); one chunk for the whole batch
    when ``chunk_samples`` is None."""
    if not n:
        return []
    size = n if chunk_samples is None else -(-max(chunk_samples, 1) // group_size) * group_size
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def score_functions(
    functions: list[RewardFunction],
    *,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    on_error: str,
    timeout_s: float,
    chunk_samples: int | None = None,
    group_size: int = 1,
    pool: RewardPool | None = None,
) -> RewardResult:
    """Call each function on each chunk of the batch (``chunks_of``) and combine the weighted
    scores.

    ``columns`` maps each dataset column to a list aligned with ``completions``. A call that raises,
    runs past ``timeout_s``, or (in a ``pool``) ends its worker process scores 0.0 on its chunk; one
    that returns a list of the wrong length or a non-list does too; each bad item (not a number,
    None or RewardError, or not finite) and each RewardError item scores 0.0 alone. With
    ``on_error="fail"`` any of these raises RewardFailure instead.

    With a ``pool`` the calls run in its worker processes, where a timed-out call is killed with its
    worker. Without one they run in this process: a sync call that times out is abandoned (Python
    cannot kill a thread, so it keeps running, holding its CPU and memory, until it returns); an
    async call that times out is cancelled.
    """
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
    n = len(completions)
    _check_aligned(n, [("prompts", prompts), ("completion_ids", completion_ids), *columns.items()])
    check_columns(columns)

    keys = unique_names(functions)
    chunks = chunks_of(n, chunk_samples, group_size)

    def chunk_kwargs(lo: int, hi: int) -> dict[str, Any]:
        # Fresh lists per call: a function that mutates its inputs (or a timed-out one still
        # running) cannot change what the next function sees.
        return {
            "prompts": prompts[lo:hi],
            "completions": completions[lo:hi],
            "completion_ids": [list(ids) for ids in completion_ids[lo:hi]],
            **{name: values[lo:hi] for name, values in columns.items()},
        }

    outcomes = _call_each(functions, keys, chunks, chunk_kwargs, timeout_s, pool)
    return _combine(functions, keys, chunks, outcomes, n, on_error)


def _check_aligned(n: int, inputs: list[tuple[str, list]]) -> None:
    """Every input, as (name, values), has one entry per completion."""
    for what, values in inputs:
        if len(values) != n:
            raise ValueError(
                f"{what} has {len(values)} entries for {n} completions; every input must be aligned"
            )


def _call_each(
    functions: list[RewardFunction],
    keys: list[str],
    chunks: list[tuple[int, int]],
    chunk_kwargs: Callable[[int, int], dict[str, Any]],
    timeout_s: float,
    pool: RewardPool | None,
) -> dict[tuple[int, int], Any]:
    """Each (function index, chunk index) call's value or Failed: in the pool's worker processes,
    or, without a pool, in this process."""
    calls = [(k, c) for k in range(len(functions)) for c in range(len(chunks))]
    if pool is not None:
        returned = pool.run([(k, chunk_kwargs(*chunks[c])) for k, c in calls], timeout_s)
        return dict(zip(calls, returned, strict=True))
    return _in_process(
        {call: (functions[call[0]].fn, chunk_kwargs(*chunks[call[1]])) for call in calls},
        keys,
        timeout_s,
    )


def _combine(
    functions: list[RewardFunction],
    keys: list[str],
    chunks: list[tuple[int, int]],
    outcomes: dict[tuple[int, int], Any],
    n: int,
    on_error: str,
) -> RewardResult:
    """The calls' outcomes as scores, function by function and chunk by chunk (failures contained
    or raised per ``on_error``), and their weighted sum."""
    total = [0.0] * n
    result = RewardResult(total=total, per_function={}, errors={}, nones={})
    for k, (key, func) in enumerate(zip(keys, functions, strict=True)):
        scores: list[float] = []
        errors = nones = 0
        for c, (lo, hi) in enumerate(chunks):
            chunk_scores, chunk_errors, chunk_nones = _collect(
                key, outcomes[(k, c)], hi - lo, on_error
            )
            scores += chunk_scores
            errors, nones = errors + chunk_errors, nones + chunk_nones
        result.per_function[key], result.errors[key], result.nones[key] = scores, errors, nones
        for i, value in enumerate(scores):
            total[i] += func.weight * value
    return result


# The reward models' scores of a batch: each model's spec and its score of every sample
# (grpo_ds.reward_models).
ModelScores = Sequence[tuple[RewardModelSpec, Sequence[float]]]


def add_model_scores(result: RewardResult, models: ModelScores) -> RewardResult:
    """The reward models' scores (grpo_ds.reward_models, already normalised), as (spec, score per
    sample), join the functions': ``total[i] += spec.weight * score[i]``, and
    ``per_function[spec.name]`` holds the unweighted score, so the metrics treat a model like a
    function (a model neither fails nor returns None: no errors, no nones)."""
    total = list(result.total)
    per_function, errors, nones = dict(result.per_function), dict(result.errors), dict(result.nones)
    for spec, scores in models:
        name, weight = spec.name, spec.weight
        if len(scores) != len(total):
            raise ValueError(f"reward model {name!r} scored {len(scores)} samples of {len(total)}")
        per_function[name], errors[name], nones[name] = list(scores), 0, 0
        total = [t + weight * s for t, s in zip(total, scores, strict=True)]
    return RewardResult(total=total, per_function=per_function, errors=errors, nones=nones)


def _in_process(
    jobs: dict[tuple[int, int], tuple[Any, dict[str, Any]]], keys: list[str], timeout_s: float
) -> dict[tuple[int, int], Any]:
    """Each (function, chunk) call's value or Failed, run in this process: the sync ones one after
    another in a thread each, the async ones together in one event loop."""
    async_calls = [call for call, (fn, _) in jobs.items() if _is_async(fn)]
    batch = (
        _AsyncBatch({call: jobs[call] for call in async_calls}, timeout_s) if async_calls else None
    )
    outcomes = {
        call: _outcome(keys[call[0]], fn, kwargs, timeout_s)
        for call, (fn, kwargs) in jobs.items()
        if call not in async_calls
    }
    if batch is not None:
        outcomes.update(batch.results())
    return outcomes


def _is_async(fn: Any) -> bool:
    """An ``async def`` function (or partial of one, or an object with an
    ``async def __call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _outcome(key: str, fn: Any, kwargs: dict[str, Any], timeout_s: float) -> Any:
    """A sync function's value, or its Failed."""
    try:
        return _call_with_timeout(key, fn, kwargs, timeout_s)
    except Failed as failure:
        return failure


def _collect(key: str, outcome: Any, n: int, on_error: str) -> tuple[list[float], int, int]:
    """One function's (scores, error count, None count), with failures contained or raised per
    on_error."""
    try:
        if isinstance(outcome, Failed):
            raise outcome
        values = _check_length(outcome, n)
    except Failed as failure:
        _handle(key, failure, on_error, samples=n)
        return [0.0] * n, n, 0

    scores, bad, item_errors, nones = [], [], {}, 0
    for i, value in enumerate(values):
        if value is None:
            nones += 1
            scores.append(0.0)
        elif isinstance(value, RewardError):
            item_errors.setdefault(value.kind, []).append(i)
            scores.append(0.0)
        elif isinstance(value, numbers.Real) and math.isfinite(float(value)):
            scores.append(float(value))
        else:
            bad.append(i)
            scores.append(0.0)
    for kind, indices in item_errors.items():
        first = values[indices[0]]
        failure = Failed(
            f"item:{kind}",
            f"failed on {len(indices)} of {n} samples "
            f"({kind}; sample {indices[0]}: {first.message})",
        )
        _handle(key, failure, on_error, samples=len(indices))
    if bad:
        first = values[bad[0]]
        failure = Failed(
            "bad_item",
            f"returned {len(bad)} of {n} items that are not a finite number, None or RewardError "
            f"(item {bad[0]} is {first!r} of type {type(first).__name__})",
        )
        _handle(key, failure, on_error, samples=len(bad))
    return scores, len(bad) + sum(len(indices) for indices in item_errors.values()), nones


def _call_with_timeout(key: str, fn: Any, kwargs: dict[str, Any], timeout_s: float) -> Any:
    """Run ``fn(**kwargs)`` in a daemon thread; return its value or raise Failed (raised /
    timeout)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            value = fn(**kwargs)
            # a sync callable that hands back a coroutine: run it here
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            box["value"] = value
        except BaseException as err:  # SystemExit too: a reward function must not end the run
            box["error"] = err

    thread = threading.Thread(target=target, name=f"reward:{key}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Failed(
            "timeout",
            f"took longer than reward.timeout_s={timeout_s:g}s "
            "(the call is abandoned and may still be running)",
        )
    if "error" in box:
        raise _raised(box["error"])
    return box["value"]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _raised(err: BaseException) -> Failed:
    return Failed("raised", f"raised {type(err).__name__}: {err}", cause=err)


# Extra wait for the event loop thread beyond timeout_s: asyncio cancels a timed-out coroutine at
# its next await, so a well-behaved one is done well within this.
_ASYNC_GRACE_S = 0.5


class _AsyncBatch:
    """The step's async functions, awaited concurrently in one event loop on a daemon thread."""

    def __init__(self, jobs: dict[str, tuple[Any, dict[str, Any]]], timeout_s: float) -> None:
        self._jobs, self._timeout_s = jobs, timeout_s
        self._deadline = time.monotonic() + timeout_s + _ASYNC_GRACE_S
        self._done: dict[str, Any] = {}
        self._crash: BaseException | None = None
        # Set when every function has an outcome; asyncio.run may take longer to return (it waits
        # for the loop's worker threads, e.g. sandboxed programs that a cancelled call had started).
        self._finished = threading.Event()
        threading.Thread(target=self._run, name="reward:async", daemon=True).start()

    def _run(self) -> None:
        try:
            asyncio.run(self._gather())
        # SystemExit/KeyboardInterrupt in a task escape the loop: contain them
        except BaseException as err:
            self._crash = err
        finally:
            self._finished.set()

    async def _gather(self) -> None:
        async def one(key: str, fn: Any, kwargs: dict[str, Any]) -> None:
            try:
                task = asyncio.ensure_future(fn(**kwargs))
            except Exception as err:  # noqa: BLE001 - e.g. a TypeError from the call itself
                self._done[key] = _raised(err)
                return
            finished, _ = await asyncio.wait({task}, timeout=self._timeout_s)
            if not finished:
                task.cancel()
                self._done[key] = Failed(
                    "timeout",
                    f"took longer than reward.timeout_s={self._timeout_s:g}s "
                    "(the call was cancelled)",
                )
            elif task.exception() is not None:
                self._done[key] = _raised(task.exception())
            else:
                self._done[key] = task.result()

        await asyncio.gather(*(one(key, fn, kwargs) for key, (fn, kwargs) in self._jobs.items()))
        self._finished.set()

    def results(self) -> dict[str, Any]:
        """Each function's value or Failed; a function still running (the loop is stuck) counts as
        timed out."""
        self._finished.wait(max(0.0, self._deadline - time.monotonic()))
        done = dict(self._done)
        for key in self._jobs:
            if key not in done:
                done[key] = (
                    _raised(self._crash)
                    if self._crash is not None
                    else Failed(
                        "timeout",
                        f"took longer than reward.timeout_s={self._timeout_s:g}s (the call blocks "
                        "its event loop and is abandoned)",
                    )
                )
        return done


def _check_length(values: Any, n: int) -> list[Any]:
    """The return value as a list of n items, or Failed("bad_return"). Arrays and tensors are
    accepted."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise Failed(
            "bad_return", f"returned a {type(values).__name__}, expected a list of {n} floats"
        )
    if len(values) != n:
        raise Failed("bad_return", f"returned {len(values)} scores for {n} completions")
    return list(values)


def _handle(key: str, failure: Failed, on_error: str, samples: int) -> None:
    """Raise RewardFailure (on_error="fail"), or warn once per (function, kind) that the samples
    score 0."""
    if on_error == "fail":
        raise RewardFailure(key, str(failure)) from failure.cause
    if (key, failure.kind) not in _WARNED:
        _WARNED.add((key, failure.kind))
        logger.warning(
            "reward function %r %s; %d sample(s) score 0.0 for it (reward.on_error=zero; this "
            "warning is shown once, the count is in the metrics)",
            key,
            failure,
            samples,
        )
