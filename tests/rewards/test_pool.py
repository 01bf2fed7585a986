"""Reward worker processes: the same scores whatever the number of workers, a crash or a hang costs
one chunk (and its worker, which is replaced), "fail" stops with one line naming the function, and
nothing piles up."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_ds.config.reward_specs import RewardFunctionSpec
from grpo_ds.errors import UserError
from grpo_ds.rewards import RewardFailure, load_reward_functions, score_functions, scoring
from grpo_ds.rewards.pool import RewardPool, worker_count
from tests.launch import REPO, gone, stat_fields

HERE = "tests.rewards.pool_functions"
G = 4  # completions per prompt; a chunk holds whole groups
COMPLETIONS = ["7", "12", "7 ", "x", "exit", "3", "3", "hang", "crash", "big", "5", "5"] * 2
ANSWERS = [str(i % 13) for i in range(len(COMPLETIONS))]


def specs(*names: str) -> list[RewardFunctionSpec]:
    return [
        RewardFunctionSpec(name if name == "exact_match" else f"{HERE}:{name}", 1.0)
        for name in names
    ]


def run(
    spec: list[RewardFunctionSpec],
    pool: RewardPool | None,
    completions=None,
    on_error="zero",
    timeout_s=20.0,
    chunk_samples=G,
):
    completions = COMPLETIONS if completions is None else completions
    n = len(completions)
    return score_functions(
        load_reward_functions(spec),
        prompts=[f"p{i // G}" for i in range(n)],
        completions=completions,
        completion_ids=[[i] for i in range(n)],
        columns={"answer": ANSWERS[:n]},
        on_error=on_error,
        timeout_s=timeout_s,
        chunk_samples=chunk_samples,
        group_size=G,
        pool=pool,
    )


def children() -> list[int]:
    """This process's child processes, from /proc, zombies included (an unreaped worker piles up
    too). Only hang_rounds' fresh interpreter calls it, whose children are the pool's workers alone.
    Not matched by command line: a worker that Popen has just started can read an empty
    /proc/PID/cmdline for a while after its exec (CI once counted 1 of 2 that way), and here right
    after Popen it does more often than not."""
    return sorted(
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and (fields := stat_fields(entry.name))
        and int(fields[1]) == os.getpid()
    )


def threads() -> int:
    """This process's threads, the fewest of 10 reads over half a second: an abandoned thread stays
    and is counted, and a task that /proc lists for an instant (CI once saw one more at the end of
    hang_rounds, with no thread of this process started) is not."""
    counts = []
    for _ in range(10):
        counts.append(len(os.listdir("/proc/self/task")))
        time.sleep(0.05)
    return min(counts)


def thread_names() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # ended meanwhile
            pass
    return names


@pytest.fixture
def pools():
    started = []

    def make(spec, processes, **kwargs):
        started.append(RewardPool(spec, processes, **kwargs))
        return started[-1]

    yield make
    for pool in started:
        pool.close()


def test_scores_are_equal_across_one_two_and_three_workers_and_in_process(pools):
    spec = specs("exact_match", "length", "matches", "slow_async")
    safe = [c for c in COMPLETIONS if c not in ("exit", "hang", "crash", "big")][:16]
    expected = run(spec, None, safe)
    assert expected.total and any(expected.total)
    for processes in (1, 2, 3):
        got = run(spec, pools(spec, processes), safe)
        assert got.total == expected.total and got.per_function == expected.per_function, processes
        assert got.errors == expected.errors and got.nones == expected.nones
    # one call on the whole batch
    assert run(spec, None, safe, chunk_samples=None).total == expected.total


@pytest.mark.parametrize(
    "name, how", [("exits", "exited with code 3"), ("segfaults", "killed by signal SIGSEGV")]
)
def test_a_reward_that_ends_its_process_costs_its_chunk_under_zero(
    pools, name, how, caplog, monkeypatch
):
    monkeypatch.setattr(scoring, "_WARNED", set())  # each failure mode warns once per process
    spec = specs(name, "length")
    key = f"{HERE}:{name}"
    pool = pools(spec, 2)
    before = pool.pids()
    result = run(spec, pool)
    word = {"exits": "exit", "segfaults": "crash"}[name]
    # the chunks (groups) that hold the word
    hit = {i // G for i, c in enumerate(COMPLETIONS) if c == word}
    expected = [0.0 if i // G in hit else 1.0 for i in range(len(COMPLETIONS))]
    assert result.per_function[key] == expected
    assert result.errors[key] == G * len(hit)
    # the other one is untouched
    assert result.per_function[f"{HERE}:length"] == [len(c) / 10 for c in COMPLETIONS]
    assert f"reward function '{key}' ended its worker process ({how}" in caplog.text
    assert pool.replaced == len(hit) and len(pool.pids()) == 2 and set(pool.pids()) != set(before)
    assert run(spec, pool).errors[key] == G * len(hit)  # the replacements work


@pytest.mark.parametrize(
    "name, how", [("exits", "exited with code 3"), ("segfaults", "killed by signal SIGSEGV")]
)
def test_a_reward_that_ends_its_process_stops_the_run_with_one_line_under_fail(pools, name, how):
    spec = specs(name)
    with pytest.raises(RewardFailure) as stopped:
        run(spec, pools(spec, 2), on_error="fail")
    assert isinstance(stopped.value, UserError)  # printed as one line, exit 2
    line = str(stopped.value)
    assert "\n" not in line and line.startswith(
        f"reward function '{HERE}:{name}': ended its worker process ({how}"
    )


def test_a_hanging_reward_is_killed_at_its_timeout_and_nothing_piles_up_over_20_steps():
    """Run in a fresh interpreter, whose processes and threads are the pool's alone (tests before
    this one in this process leave threads and sandboxed programs that end on their own)."""
    done = subprocess.run(
        [sys.executable, "-c", "from tests.rewards.test_pool import hang_rounds; hang_rounds()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "20 rounds: 2 workers, 21 replaced, threads flat"


def hang_rounds() -> None:
    """20 rounds with a spinning reward: each is killed at its timeout, and the processes and
    threads stay flat."""
    spec = specs("hangs", "length")
    pool = RewardPool(spec, 2)
    try:
        # the first chunk (group) hangs, the second does not
        batch = ["hang", "1", "2", "3", "4", "5", "6", "7"]
        run(spec, pool, batch, timeout_s=1.0)
        procs, thread_count = children(), threads()
        assert procs == sorted(pool.pids()) and len(procs) == 2, (procs, pool.pids())
        started = time.monotonic()
        for _ in range(20):
            result = run(spec, pool, batch, timeout_s=0.5)
            assert result.per_function[f"{HERE}:hangs"] == [0.0] * G + [1.0] * G
            assert result.errors[f"{HERE}:hangs"] == G
        # each round waits the timeout and a worker's start
        assert time.monotonic() - started < 20 * (0.5 + 2.0)
        after = children()
        assert after == sorted(pool.pids()) and len(after) == len(procs), (
            procs,
            after,
            pool.pids(),
        )
        assert threads() == thread_count, (
            f"{thread_count} threads before the rounds, now {thread_names()}"
        )
        assert pool.replaced == 21  # one killed and replaced per round
    finally:
        pool.close()
    print(f"20 rounds: {len(procs)} workers, {pool.replaced} replaced, threads flat")


def test_memory_per_worker_is_bounded(pools):
    spec = specs("allocates")
    result = run(spec, pools(spec, 1, memory_gib=1.0), ["big", "1", "2", "3", "4", "5", "6", "7"])
    # MemoryError: that chunk scores 0
    assert result.per_function[f"{HERE}:allocates"] == [0.0] * G + [1.0] * G
    # unbounded: fits
    assert run(spec, pools(spec, 1), ["big", "1", "2", "3"]).errors[f"{HERE}:allocates"] == 0


def test_sandboxed_code_keeps_its_own_confinement_in_a_worker(pools):
    """code_exec in a worker: the good program passes its tests, and the sandbox still blocks a
    network call."""
    spec = [RewardFunctionSpec("code_exec", 1.0)]
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    network = "```python\nimport socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)\n```"
    tests = "assert add(2, 3) == 5"
    result = score_functions(
        load_reward_functions(spec),
        prompts=["p", "p"],
        completions=[good, network],
        completion_ids=[[1], [2]],
        columns={"tests": [tests, tests]},
        on_error="zero",
        timeout_s=60,
        chunk_samples=1,
        pool=pools(spec, 2),
    )
    assert result.per_function["code_exec"] == [1.0, 0.0] and result.errors["code_exec"] == 1


def test_a_function_that_does_not_load_in_a_worker_is_one_line(pools, tmp_path, monkeypatch):
    module = tmp_path / "loads_once.py"
    marker = tmp_path / "loaded"
    module.write_text(
        f"import pathlib\nm = pathlib.Path({str(marker)!r})\nif m.exists():\n"
        "    raise RuntimeError('second import')\nm.touch()\n\ndef f(**kw):\n    return [1.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = [RewardFunctionSpec("loads_once:f", 1.0)]
    functions = load_reward_functions(spec)  # the trainer's import succeeds; the worker's raises
    pool = pools(spec, 1)
    with pytest.raises(
        UserError,
        match="a reward worker process could not load the reward functions .*second import",
    ):
        score_functions(
            functions,
            prompts=["p"],
            completions=["c"],
            completion_ids=[[1]],
            columns={},
            on_error="zero",
            timeout_s=10,
            pool=pool,
        )


def test_start_up_waits_for_the_workers_and_refuses_one_that_cannot_load(pools, tmp_path):
    """RewardPool.wait_ready (the session calls it before training): returns once every worker has
    loaded the functions, and a worker that cannot is the one-line error at start-up, not at the
    first step's call."""
    module = tmp_path / "never_loads.py"
    module.write_text("raise RuntimeError('cannot load here')\n")
    ready = pools([RewardFunctionSpec("exact_match", 1.0)], 2)
    ready.wait_ready()
    assert ready.run([(0, {"completions": ["4"], "answer": ["4"]})], 10) == [[1.0]]
    sys.path.insert(0, str(tmp_path))
    try:
        refused = pools([RewardFunctionSpec("never_loads:f", 1.0)], 2)
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(UserError, match="could not load the reward functions .*cannot load here"):
        refused.wait_ready()


def test_the_default_is_one_worker_per_usable_core_at_most_eight():
    assert worker_count(None) == min(8, len(os.sched_getaffinity(0))) and worker_count(0) == 0
    assert worker_count(3) == 3


def test_a_worker_that_died_while_idle_is_replaced_before_its_next_call(pools):
    spec = specs("length")
    pool = pools(spec, 1)
    run(spec, pool, ["a", "b", "c", "d"])
    dead = pool.pids()[0]
    os.kill(dead, 9)  # between two steps: nothing was running on it
    deadline = time.monotonic() + 10
    # dead before the next call, however busy the machine
    while not gone(dead) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run(spec, pool, ["a", "b", "c", "d"]).errors[f"{HERE}:length"] == 0
    assert pool.replaced == 1
