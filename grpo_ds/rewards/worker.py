"""One reward worker process: ``python -m grpo_ds.rewards.worker IN_FD OUT_FD`` (started by
``rewards.pool``).

It reads messages from the pipe IN_FD and answers on OUT_FD (``multiprocessing.connection`` framing,
pickled):
1. ``{"sys_path", "specs", "memory_bytes"}``: put the trainer's import path in place, bound the
   address space (``RLIMIT_AS``) if asked, load the recipe's reward functions by name, exactly as
   the trainer did, and answer ``("ready", None)``, or ``("init_error", message)`` and exit;
2. then any number of ``(task_id, function_index, kwargs)``: call that function on one chunk of the
   batch (awaiting it if it is ``async``) and answer ``(task_id, "ok", values)`` or
   ``(task_id, "raised", message)``.
It exits when the trainer closes IN_FD. The trainer alone keeps time: a call past
``reward.timeout_s`` has its worker killed, so nothing here waits on a clock.

Only the standard library and grpo_ds.rewards are imported (no torch), so a worker starts in a
fraction of a second.
"""

from __future__ import annotations

import asyncio
import inspect
import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any


def _call(fn: Any, kwargs: dict[str, Any]) -> Any:
    value = fn(**kwargs)
    # an async def function, or a sync one that hands back a coroutine
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    # arrays and tensors travel as lists
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    return value


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _load(init: dict[str, Any]) -> list[Any]:
    sys.path[:] = init["sys_path"]
    if init["memory_bytes"]:
        resource.setrlimit(resource.RLIMIT_AS, (init["memory_bytes"], init["memory_bytes"]))
    from grpo_ds.rewards.loading import load_reward_functions

    return [f.fn for f in load_reward_functions(init["specs"])]


def _die_with_the_trainer() -> None:
    """Linux: SIGKILL this worker when the trainer that started it dies (a SIGKILL gives it no time
    to close the pool), so a hanging call never outlives its run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _outlast_stop_signals() -> None:
    """A stop signal is the trainer's to act on, not this worker's: DeepSpeed's launcher sends
    SIGTERM to every process under a rank, and a worker that died of it mid-call would fail that
    call, and the step would go on with the failure's score. The trainer kills its workers itself
    when it stops (grpo_ds/run/preemption.py). A handler that does nothing, not SIG_IGN: what the
    user's code starts gets the default actions back when it execs."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


def serve(inbox: Connection, outbox: Connection) -> None:
    _die_with_the_trainer()
    _outlast_stop_signals()
    try:
        init = inbox.recv()
    except (EOFError, OSError):  # the trainer was gone before the worker started: nothing to do
        return
    try:
        functions = _load(init)
    except BaseException as err:  # noqa: BLE001 - a UserError, or the user's module failing in this process
        try:
            outbox.send(("init_error", f"{type(err).__name__}: {err}"))
        except OSError:  # the trainer is gone: no one to tell
            pass
        return
    outbox.send(("ready", None))
    while True:
        try:
            task_id, index, kwargs = inbox.recv()
        except EOFError:  # the trainer closed the pool
            return
        try:
            answer = (task_id, "ok", _call(functions[index], kwargs))
        except BaseException as err:  # noqa: BLE001 - SystemExit too: a reward function must not end the worker
            answer = (task_id, "raised", f"raised {type(err).__name__}: {err}")
        try:
            outbox.send(answer)
        except Exception as err:  # noqa: BLE001 - a value that does not pickle
            outbox.send(
                (
                    task_id,
                    "bad_return",
                    f"returned a value that cannot be sent back ({type(err).__name__}: {err})",
                )
            )


if __name__ == "__main__":
    serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
