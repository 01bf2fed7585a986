"""Built-in reward ``code_exec``: run the completion's Python, then the row's tests, in the sandbox.

For each sample, the program is the completion's code — the last fenced block tagged ``python`` (or
``py``, ``python3``), else the last untagged fenced block, else the whole completion — followed by
the dataset's ``tests`` column (a string of Python, typically ``assert`` statements, or a list of
such strings). It runs in ``grpo_ds.rewards.sandbox`` (a separate, confined process; never the
training process). If the code calls ``sys.exit()`` (as in ``sys.exit(main())``), the tests still
run afterwards.

Scores: 1.0 when the program finishes (the tests pass), 0.0 when it fails (a failed assert, an
exception, a syntax error, a non-zero exit). A program that runs out of time or memory, writes more
than its disk bound (64 MiB in total by default), or tries something the sandbox forbids (a process,
a socket, a file outside its folder), is contained and reported as a per-sample ``RewardError``, so
``reward.on_error`` decides: "zero" scores it 0.0 and counts it in ``reward_errors/code_exec``;
"fail" stops the run. A row whose ``tests`` is None gets None (no score).

The function is ``async``: samples run concurrently, at most ``max_parallel`` programs at a time
(default: the machine's CPU count), and when ``reward.timeout_s`` cancels the call, no new program
starts (running ones end within their own wall-time limit). Size ``reward.timeout_s`` for the worst
case: about ceil(samples / max_parallel) x wall_s, plus ~0.1 s per program to start.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from typing import Any

from grpo_ds.rewards.item_error import RewardError
from grpo_ds.rewards.sandbox import (
    DEFAULT_CPU_S,
    DEFAULT_DISK_MB,
    DEFAULT_MEMORY_MB,
    DEFAULT_WALL_S,
    SandboxResult,
    run_python,
)

TESTS_COLUMN = "tests"  # the dataset column holding each row's test code
_PYTHON_BLOCK = re.compile(
    r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE
)
_UNTAGGED_BLOCK = re.compile(r"```[ \t]*\r?\n(.*?)```", re.DOTALL)
_WHAT = {
    "timeout": "ran past its time limit",
    "memory": "ran out of memory",
    "blocked": "was blocked",
}


def extract_code(completion: str) -> str:
    """The code in a completion: the last ```python block, else the last untagged ``` block, else
    all of it."""
    for pattern in (_PYTHON_BLOCK, _UNTAGGED_BLOCK):
        blocks = pattern.findall(completion)
        if blocks:
            return blocks[-1]
    return completion


def build_program(code: str, tests: str | list[str]) -> str:
    """The program that the sandbox runs: the code (as ``__main__``; an exit is caught), then the
    tests."""
    test_code = "\n".join(tests) if isinstance(tests, (list, tuple)) else str(tests)
    return (
        "try:\n"
        f"    exec(compile({code!r}, '<solution>', 'exec'))\n"
        "except SystemExit:\n"
        "    pass  # sys.exit(main()) ends the solution, not the test run\n"
        f"{test_code}\n"
    )


def make_code_exec(
    *,
    wall_s: float = DEFAULT_WALL_S,
    cpu_s: float = DEFAULT_CPU_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    disk_mb: int = DEFAULT_DISK_MB,
    max_parallel: int | None = None,
    tests_column: str = TESTS_COLUMN,
) -> Callable[..., Any]:
    """A ``code_exec`` reward with other limits; put it in your module and name it in the recipe::

    # my_rewards.py                          recipe: {"name": "my_rewards:code_exec_fast"}
    from grpo_ds.rewards.code_exec import make_code_exec
    code_exec_fast = make_code_exec(wall_s=3, memory_mb=512, disk_mb=16, max_parallel=8)

    The limits are ``run_python``'s: ``wall_s`` seconds, ``cpu_s`` CPU seconds, ``memory_mb`` MiB of
    address space and ``disk_mb`` MiB written in total (all files together) per program.
    """
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"max_parallel must be at least 1, got {max_parallel}")

    async def code_exec(
        *, completions: list[str], **columns: Any
    ) -> list[float | RewardError | None]:
        tests = columns.get(tests_column)
        if tests is None:
            raise ValueError(
                f"code_exec needs a dataset column named {tests_column!r} holding each row's test "
                "code (e.g. assert statements)"
            )
        slots = asyncio.Semaphore(max_parallel or os.cpu_count() or 1)

        async def one(completion: str, row_tests: Any) -> float | RewardError | None:
            if row_tests is None:
                return None
            program = build_program(extract_code(completion), row_tests)
            async with slots:
                result = await asyncio.to_thread(
                    run_python,
                    program,
                    wall_s=wall_s,
                    cpu_s=cpu_s,
                    memory_mb=memory_mb,
                    disk_mb=disk_mb,
                )
            return sandbox_score(result)

        return list(
            await asyncio.gather(*(one(c, t) for c, t in zip(completions, tests, strict=True)))
        )

    return code_exec


def sandbox_score(result: SandboxResult) -> float | RewardError:
    """1.0 for a program that finished, 0.0 for one that failed, a RewardError for one the sandbox
    contained."""
    if result.status == "ok":
        return 1.0
    if result.status == "error":
        return 0.0
    last = next((line for line in reversed(result.stderr.splitlines()) if line.strip()), "")
    return RewardError(
        result.status, f"the program {_WHAT[result.status]}" + (f": {last.strip()}" if last else "")
    )


code_exec = make_code_exec()
