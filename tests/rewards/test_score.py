"""score_functions(): weighted totals, None handling, and containment of failing reward
functions."""

import asyncio
import functools
import logging
import math
import threading
import time

import pytest

from grpo_ds.errors import UserError
from grpo_ds.rewards import RewardError, RewardFailure, RewardFunction, score_functions, scoring
from grpo_ds.rewards.builtin import exact_match, format_reward

COMPLETIONS = ["#### 1", "#### 2", "no answer"]
ANSWERS = ["1", "3", "5"]


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees warn-once state from scratch."""
    scoring._WARNED.clear()
    yield
    scoring._WARNED.clear()


def run(functions, on_error="zero", timeout_s=5.0, completions=COMPLETIONS, **columns):
    n = len(completions)
    return score_functions(
        functions,
        prompts=["p"] * n,
        completions=completions,
        completion_ids=[[7, 8]] * n,
        columns=columns or {"answer": ANSWERS},
        on_error=on_error,
        timeout_s=timeout_s,
    )


def fn(name, weight, f):
    return RewardFunction(name=name, weight=weight, fn=f)


def raising(**kwargs):
    raise ZeroDivisionError("bad reward")


def test_weights_combine():
    res = run([fn("exact_match", 2.0, exact_match), fn("format", 0.5, format_reward)])
    assert res.per_function == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}
    assert res.total == [2.5, 0.5, 0.0]
    assert res.errors == {"exact_match": 0, "format": 0} and res.nones == {
        "exact_match": 0,
        "format": 0,
    }


def test_functions_receive_documented_arguments_and_columns():
    seen = {}

    def spy(*, prompts, completions, completion_ids, **columns):
        seen.update(
            prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns
        )
        return [0.0] * len(completions)

    run([fn("spy", 1.0, spy)], answer=ANSWERS, level=["a", "b", "c"])
    assert seen["completions"] == COMPLETIONS and seen["prompts"] == ["p"] * 3
    assert seen["completion_ids"] == [[7, 8]] * 3
    assert seen["columns"] == {"answer": ANSWERS, "level": ["a", "b", "c"]}


def test_repeated_names_are_disambiguated():
    res = run([fn("format", 1.0, format_reward), fn("format", 3.0, format_reward)])
    assert list(res.per_function) == ["format", "format#2"]
    assert res.total == [4.0, 4.0, 0.0]


def test_raising_function_is_contained(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_ds.rewards"):
        res = run([fn("boom", 1.0, raising), fn("format", 1.0, format_reward)])
    assert res.per_function["boom"] == [0.0, 0.0, 0.0] and res.errors["boom"] == 3
    assert res.per_function["format"] == [1.0, 1.0, 0.0] and res.errors["format"] == 0
    assert res.total == [1.0, 1.0, 0.0]
    assert "boom" in caplog.text and "ZeroDivisionError: bad reward" in caplog.text


def test_warning_is_logged_once_per_function_and_kind(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_ds.rewards"):
        for _ in range(3):
            res = run([fn("boom", 1.0, raising)])
    assert res.errors["boom"] == 3  # still counted every step
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1


def test_timeout_is_contained_and_fast():
    release = threading.Event()

    def slow(*, completions, **kwargs):
        release.wait(10.0)
        return [1.0] * len(completions)

    try:
        start = time.monotonic()
        res = run([fn("slow", 1.0, slow), fn("format", 1.0, format_reward)], timeout_s=0.2)
        elapsed = time.monotonic() - start
    finally:
        release.set()  # let the abandoned thread finish
    assert elapsed < 5.0  # abandoned at the 0.2 s timeout, not waited for (10 s)
    assert res.per_function["slow"] == [0.0, 0.0, 0.0] and res.errors["slow"] == 3
    assert res.total == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("bad", [[1.0, 1.0], "1.0", 3.0, None])
def test_bad_return_value_zeroes_the_batch(bad):
    res = run([fn("bad", 1.0, lambda **kw: bad), fn("format", 1.0, format_reward)])
    assert res.per_function["bad"] == [0.0, 0.0, 0.0] and res.errors["bad"] == 3
    assert res.total == [1.0, 1.0, 0.0]


def test_none_and_bad_items_are_per_item():
    res = run(
        [
            fn("mixed", 2.0, lambda **kw: [None, float("nan"), True]),
            fn("items", 1.0, lambda **kw: (1, "x", math.inf)),
        ]
    )
    assert res.per_function["mixed"] == [0.0, 0.0, 1.0]
    assert res.nones["mixed"] == 1 and res.errors["mixed"] == 1
    assert res.per_function["items"] == [1.0, 0.0, 0.0] and res.errors["items"] == 2
    assert res.total == [1.0, 0.0, 2.0]


def test_array_like_return_is_accepted():
    class FakeArray:  # numpy arrays and torch tensors both offer .tolist()
        def tolist(self):
            return [0.25, 0.5, 1.0]

    res = run([fn("arr", 1.0, lambda **kw: FakeArray())])
    assert res.per_function["arr"] == [0.25, 0.5, 1.0] and res.errors["arr"] == 0


def test_system_exit_in_a_function_is_contained():
    def quits(**kwargs):
        raise SystemExit(3)

    res = run([fn("quits", 1.0, quits)])
    assert res.errors["quits"] == 3


def test_mutating_inputs_does_not_leak_to_the_next_function():
    def mutate(*, completions, completion_ids, **kwargs):
        completions[0] = "#### 999"
        completion_ids[0].append(0)
        return [0.0] * len(completions)

    res = run([fn("mutate", 1.0, mutate), fn("exact_match", 1.0, exact_match)])
    assert res.per_function["exact_match"] == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "f, cause",
    [
        (raising, "ZeroDivisionError"),
        (lambda **kw: [1.0], "returned 1 scores"),
        (lambda **kw: [1.0, None, "x"], "not a finite number"),
    ],
)
def test_on_error_fail_raises(f, cause):
    with pytest.raises(RewardFailure, match=rf"'bad'.*{cause}"):
        run([fn("bad", 1.0, f)], on_error="fail")


def test_on_error_fail_on_timeout():
    release = threading.Event()
    try:
        with pytest.raises(RewardFailure, match="timeout_s"):
            run([fn("slow", 1.0, lambda **kw: release.wait(2.0))], on_error="fail", timeout_s=0.1)
    finally:
        release.set()


def test_empty_batch_calls_nothing():
    res = run([fn("boom", 1.0, raising)], completions=[], answer=[])
    assert res.total == [] and res.errors == {"boom": 0}


def test_misaligned_inputs_and_reserved_column_names():
    with pytest.raises(ValueError, match="answer has 2 entries"):
        run([fn("format", 1.0, format_reward)], answer=["1", "2"])
    with pytest.raises(UserError, match="'completions'"):
        score_functions(
            [fn("format", 1.0, format_reward)],
            prompts=["p"],
            completions=["1"],
            completion_ids=[[1]],
            columns={"completions": ["x"]},
            on_error="zero",
            timeout_s=1.0,
        )


# ---- per-sample errors: RewardError


def per_item(**kwargs):
    return [1.0, RewardError("timeout", "ran past 2s"), RewardError("blocked", "opened a socket")]


def test_reward_error_items_score_zero_and_count_per_sample(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_ds.rewards"):
        res = run([fn("sandboxed", 2.0, per_item), fn("format", 1.0, format_reward)])
    assert res.per_function["sandboxed"] == [1.0, 0.0, 0.0] and res.errors["sandboxed"] == 2
    assert res.total == [3.0, 1.0, 0.0] and res.errors["format"] == 0
    assert "'sandboxed' failed on 1 of 3 samples (timeout; sample 1: ran past 2s)" in caplog.text
    assert "(blocked; sample 2: opened a socket)" in caplog.text


def test_reward_error_items_with_on_error_fail():
    with pytest.raises(
        RewardFailure,
        match=r"'sandboxed': failed on 1 of 3 samples .timeout; sample 1: ran past 2s\)",
    ):
        run([fn("sandboxed", 1.0, per_item)], on_error="fail")


def test_reward_errors_and_bad_items_add_up():
    res = run([fn("mixed", 1.0, lambda **kw: [RewardError("memory", "oom"), "x", None])])
    assert res.errors["mixed"] == 2 and res.nones["mixed"] == 1


# ---- async functions


def sleeper(delay, value=1.0):
    async def reward(*, completions, **kwargs):
        await asyncio.sleep(delay)
        return [value] * len(completions)

    return reward


def meets(mine: asyncio.Event | threading.Event, other: threading.Event, patience_s: float = 5.0):
    """An async reward that says it has started (``mine``), then waits for ``other`` to start: 1.0
    when it saw it within ``patience_s``, 0.0 when not (the other one runs only after it). A
    rendezvous, not a stopwatch, so a busy machine slows it without failing it."""

    async def reward(*, completions, **kwargs):
        mine.set()
        deadline = time.monotonic() + patience_s
        while not other.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # lets the loop run the other coroutine meanwhile
        return [1.0 if other.is_set() else 0.0] * len(completions)

    return reward


def test_async_functions_run_concurrently():
    a, b = threading.Event(), threading.Event()
    res = run([fn("a", 1.0, meets(a, b)), fn("b", 2.0, meets(b, a))], timeout_s=30)
    # each saw the other start: together
    assert res.total == [3.0, 3.0, 3.0] and res.errors == {"a": 0, "b": 0}


def test_async_functions_overlap_sync_ones():
    sync_started, async_started = threading.Event(), threading.Event()

    def waits_for_async(*, completions, **kwargs):
        sync_started.set()
        return [1.0 if async_started.wait(5.0) else 0.0] * len(completions)

    res = run(
        [fn("sync", 1.0, waits_for_async), fn("async", 2.0, meets(async_started, sync_started))],
        timeout_s=30,
    )
    assert res.total == [3.0, 3.0, 3.0] and res.errors == {"sync": 0, "async": 0}


def test_async_timeout_cancels_only_that_function():
    cancelled = threading.Event()

    async def hangs(**kwargs):
        try:
            await asyncio.sleep(30)
        finally:
            cancelled.set()

    start = time.monotonic()
    res = run(
        [
            fn("hangs", 1.0, hangs),
            fn("quick", 1.0, sleeper(0.05)),
            fn("format", 1.0, format_reward),
        ],
        timeout_s=0.3,
    )
    # cancelled at 0.3 s, not left running (30 s)
    assert time.monotonic() - start < 5.0 and cancelled.wait(5.0)
    assert res.errors["hangs"] == 3 and res.per_function["quick"] == [1.0, 1.0, 1.0]
    assert res.total == [2.0, 2.0, 1.0]


def test_async_function_that_blocks_its_loop_is_abandoned():
    release = threading.Event()

    async def blocks(**kwargs):
        release.wait(10.0)  # never awaits: wait_for cannot interrupt it
        return [1.0, 1.0, 1.0]

    try:
        start = time.monotonic()
        res = run([fn("blocks", 1.0, blocks)], timeout_s=0.2)
        # abandoned at 0.2 s, not after 10
        assert time.monotonic() - start < 5.0 and res.errors["blocks"] == 3
    finally:
        release.set()


@pytest.mark.parametrize("exc", [ZeroDivisionError("bad"), SystemExit(3)])
def test_async_raise_is_contained(exc, caplog):
    async def raises(**kwargs):
        raise exc

    with caplog.at_level(logging.WARNING, logger="grpo_ds.rewards"):
        res = run([fn("raises", 1.0, raises), fn("ok", 1.0, sleeper(0.01))])
    assert res.errors["raises"] == 3 and res.per_function["raises"] == [0.0, 0.0, 0.0]
    assert type(exc).__name__ in caplog.text
    if isinstance(exc, ZeroDivisionError):
        assert res.per_function["ok"] == [1.0, 1.0, 1.0]


def test_async_failures_with_on_error_fail():
    async def raises(**kwargs):
        raise ValueError("judge unreachable")

    with pytest.raises(RewardFailure, match="'judge'.*ValueError: judge unreachable"):
        run([fn("judge", 1.0, raises)], on_error="fail")
    with pytest.raises(RewardFailure, match="timeout_s"):
        run([fn("slow", 1.0, sleeper(5))], on_error="fail", timeout_s=0.1)


def test_async_return_values_are_checked_like_sync_ones():
    async def short(**kwargs):
        return [1.0]

    async def items(**kwargs):
        return [1.0, RewardError("timeout", "t"), "x"]

    res = run([fn("short", 1.0, short), fn("items", 1.0, items)])
    assert res.errors == {"short": 3, "items": 2}


def test_async_callables_and_partials_are_awaited():
    class Judge:
        async def __call__(self, *, completions, scale, **kwargs):
            await asyncio.sleep(0.01)
            return [scale] * len(completions)

    async def scaled(*, completions, scale, **kwargs):
        return [scale] * len(completions)

    res = run(
        [
            fn("judge", 1.0, functools.partial(Judge(), scale=0.5)),
            fn("partial", 1.0, functools.partial(scaled, scale=0.25)),
        ]
    )
    assert res.per_function == {"judge": [0.5] * 3, "partial": [0.25] * 3}


def test_sync_function_returning_a_coroutine_is_awaited():
    async def inner(n):
        await asyncio.sleep(0.01)
        return [1.0] * n

    res = run([fn("wrapped", 1.0, lambda *, completions, **kw: inner(len(completions)))])
    assert res.per_function["wrapped"] == [1.0, 1.0, 1.0] and res.errors["wrapped"] == 0
