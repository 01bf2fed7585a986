"""Reward worker processes: started once per run (rank 0), fed one (function, chunk) call at a time.

A worker is ``python -m grpo_ds.rewards.worker`` (see there), in a session of its own, talking over
two pipes. What a call can do to a worker stays in that worker:
- it dies (a signal such as SIGSEGV, ``os._exit``, the kernel's OOM killer): its call fails with
  kind ``"died"``, naming the exit, and a new worker takes its place;
- it runs past ``reward.timeout_s``: the worker's whole process group is killed (whatever it started
  goes too), the call fails with kind ``"timeout"``, and a new worker takes its place.
Nothing is abandoned, so a long run keeps the same number of processes and threads whatever its
functions do. ``reward.worker_memory_gib`` bounds each worker's address space; an allocation past it
raises MemoryError in the function (a failure of kind ``"raised"``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from grpo_ds.config.reward_specs import RewardFunctionSpec
from grpo_ds.errors import UserError

# One thread per worker for the libraries that start a thread per core (numpy's BLAS, OpenMP): N
# workers on N cores do not each spawn N threads. A variable the user set wins.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# a worker that has not loaded the reward functions by then is a broken environment
START_TIMEOUT_S = 300.0
DEFAULT_MAX_PROCESSES = 8  # reward.processes=null: one worker per usable core, at most this many


def worker_count(processes: int | None) -> int:
    """``reward.processes`` resolved: null is one worker per CPU core this process may use, at most
    8."""
    if processes is not None:
        return processes
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return max(1, min(DEFAULT_MAX_PROCESSES, cores))


class Failed(Exception):
    """One call's failure: its kind (``"died"``, ``"timeout"``, ``"raised"``, ``"bad_return"``,
    ``"bad_item"``, or ``"item:<kind>"`` for RewardError items), its message, and the exception
    behind it where there is one in this process. Returned by the pool, and raised and caught inside
    grpo_ds.rewards.scoring."""

    def __init__(self, kind: str, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.kind, self.cause = kind, cause


@dataclass
class _Worker:
    process: subprocess.Popen
    inbox: Connection  # the worker reads it
    outbox: Connection  # the worker writes it
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    task: tuple | None = None  # (task_id, function_index, kwargs) in flight
    deadline: float = 0.0


def _exit_text(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class RewardPool:
    """``processes`` workers that load ``specs`` (the recipe's ``reward.functions``) as the trainer
    did."""

    def __init__(
        self, specs: Sequence[RewardFunctionSpec], processes: int, memory_gib: float | None = None
    ) -> None:
        self._init = {
            "sys_path": list(sys.path),
            "specs": specs,
            "memory_bytes": int(memory_gib * 2**30) if memory_gib else None,
        }
        self._workers = [self._start() for _ in range(processes)]
        self.replaced = 0  # workers killed or lost and started again, over the run

    def _start(self) -> _Worker:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = {**_ONE_THREAD, **os.environ}
        process = subprocess.Popen(
            [sys.executable, "-m", "grpo_ds.rewards.worker", str(to_worker_r), str(from_worker_w)],
            pass_fds=(to_worker_r, from_worker_w),
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        os.close(to_worker_r)
        os.close(from_worker_w)
        worker = _Worker(
            process,
            Connection(to_worker_w, readable=False),
            Connection(from_worker_r, writable=False),
        )
        worker.inbox.send(self._init)
        return worker

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start()
        self.replaced += 1

    @staticmethod
    def _stop(worker: _Worker) -> None:
        """Kill the worker's process group (the worker and whatever it started) and reap it."""
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        worker.process.wait()
        worker.inbox.close()
        worker.outbox.close()

    def wait_ready(self) -> None:
        """Until every worker has loaded the reward functions: one that cannot (or does not within
        START_TIMEOUT_S) is a UserError now, at start-up, rather than at the first step's call."""
        while any(not w.ready for w in self._workers):
            self._receive([], time.monotonic())
            self._expire([], 0.0)

    def run(self, tasks: list[tuple[int, dict[str, Any]]], timeout_s: float) -> list[Any]:
        """Each task ``(function_index, kwargs)``'s returned value, or a ``Failed``, in the tasks'
        order."""
        if not self._workers:
            raise RuntimeError("the reward pool is closed")
        results: list[Any] = [None] * len(tasks)
        queue = deque(enumerate(tasks))
        busy = 0
        while queue or busy:
            now = time.monotonic()
            busy += self._hand_out(queue, now + timeout_s)
            busy -= self._receive(results, now)
            busy -= self._expire(results, timeout_s)
        return results

    def _hand_out(self, queue: deque, deadline: float) -> int:
        """Send the next queued tasks to the idle workers, each due by ``deadline``; returns how
        many were sent."""
        sent = 0
        for worker in list(self._workers):
            if worker.ready and worker.task is None and queue:
                task_id, (index, kwargs) = queue.popleft()
                try:
                    worker.inbox.send((task_id, index, kwargs))
                # it died while idle (a thread of the user's code exited it): start another
                except OSError:
                    queue.appendleft((task_id, (index, kwargs)))
                    self._replace(worker)
                    continue
                worker.task, worker.deadline = (task_id, index, kwargs), deadline
                sent += 1
        return sent

    def _receive(self, results: list[Any], now: float) -> int:
        """Wait until a busy or starting worker answers or the first deadline passes, and take what
        the workers sent (results into ``results``); returns the calls that ended."""
        waiting = [w for w in self._workers if w.task is not None or not w.ready]
        deadlines = [w.deadline if w.ready else w.started + START_TIMEOUT_S for w in waiting]
        ready = (
            wait([w.outbox for w in waiting], timeout=max(0.0, min(deadlines) - now))
            if waiting
            else []
        )
        ended = 0
        for worker in [w for w in waiting if w.outbox in ready]:
            try:
                message = worker.outbox.recv()
            except (EOFError, OSError):
                ended += self._lost(worker, results)
                continue
            if message[0] == "init_error":
                self.close()
                raise UserError(
                    "reward.functions",
                    f"a reward worker process could not load the reward functions ({message[1]})",
                    "make the functions importable in a fresh Python "
                    "process started from this one's import path, or set reward.processes=0",
                )
            if message[0] == "ready":
                worker.ready = True
                continue
            task_id, kind, value = message
            results[task_id] = value if kind == "ok" else Failed(kind, value)
            worker.task = None
            ended += 1
        return ended

    def _expire(self, results: list[Any], timeout_s: float) -> int:
        """Fail the calls past their deadline and replace their workers; raise if a worker has not
        started in time. Returns the calls failed."""
        now = time.monotonic()
        expired = 0
        for worker in [w for w in self._workers if w.task is not None and w.deadline <= now]:
            results[worker.task[0]] = Failed(
                "timeout",
                f"took longer than reward.timeout_s={timeout_s:g}s (its "
                "worker process was killed and replaced)",
            )
            expired += 1
            self._replace(worker)
        if any(not w.ready and w.started + START_TIMEOUT_S <= now for w in self._workers):
            self.close()
            raise UserError(
                "reward.processes",
                f"a reward worker process did not load the reward functions "
                f"within {START_TIMEOUT_S:g} s",
                "check that importing them does not hang",
            )
        return expired

    def _lost(self, worker: _Worker, results: list[Any]) -> int:
        """A worker whose pipe ended: it died. Its call fails; a new worker replaces it. Returns the
        calls lost."""
        worker.process.wait()
        how = _exit_text(worker.process.returncode)
        # died while loading the functions (e.g. the import crashed the interpreter)
        if worker.task is None:
            self.close()
            raise UserError(
                "reward.functions",
                f"a reward worker process {how} while loading the reward functions",
                "run the functions' imports in a fresh Python process to see why, or set "
                "reward.processes=0",
            )
        results[worker.task[0]] = Failed(
            "died", f"ended its worker process ({how}; the worker was replaced)"
        )
        self._replace(worker)
        return 1

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self._workers:
            if worker.process.poll() is None or not worker.inbox.closed:
                self._stop(worker)
        self._workers = []

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]
