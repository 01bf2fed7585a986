"""Graceful preemption: a stop signal ends the run at the next step boundary, with a checkpoint.

SLURM, Kubernetes and spot instances send SIGTERM and wait before they kill (DeepSpeed's launcher forwards SIGTERM
to every rank and waits 30 s per rank); SLURM can also send SIGUSR1 ahead of the time limit
(``#SBATCH --signal=USR1@120``). On the first SIGTERM or SIGUSR1 a rank only records the request, so a checkpoint
being written when it arrives is finished. At the end of every step the ranks agree (a rank that got no signal
follows the ones that did), write a checkpoint of that step unless the schedule just wrote one, and stop with
exit code ``EXIT_PREEMPTED``; the same command then resumes from that checkpoint.

A second SIGTERM stops the process at once, by the signal's default action (the last complete checkpoint stays
intact: checkpoints are written atomically). SIGTERMs that come within ``REPEAT_WINDOW_S`` of the first count as
one request: a signal sent to the whole process group (``kill -TERM -PGID``, SLURM's ``scancel``) reaches each rank
directly and, moments later, again through DeepSpeed's launcher.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import Dist

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "a temporary failure; the same command may be retried"
REPEAT_WINDOW_S = 5.0
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped early on a signal, after ``step``; ``checkpoint`` is the checkpoint to resume from."""

    def __init__(self, signal_name: str, step: int, total_steps: int, checkpoint: str | None) -> None:
        self.signal_name, self.step, self.total_steps, self.checkpoint = signal_name, step, total_steps, checkpoint
        super().__init__(str(self))

    def __str__(self) -> str:
        where = (f"the checkpoint {self.checkpoint}" if self.checkpoint
                 else "no checkpoint (the step's weights were not finite; the previous checkpoint stays)")
        return (f"stopped by {self.signal_name} after step {self.step} of {self.total_steps}: {where}. "
                "Run the same command to resume")


class StopRequest:
    """What this process has been asked: nothing, or to stop at the next step boundary (by which signal)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_term: float | None = None

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if signum == signal.SIGTERM:
            if self._first_term is not None and now - self._first_term > REPEAT_WINDOW_S:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the second SIGTERM: stop now
                signal.raise_signal(signal.SIGTERM)
                return
            self._first_term = self._first_term or now
        if self.signal_name is None:
            self.signal_name = name
            launcher.say(f"received {name}: stopping after this step with a checkpoint (send SIGTERM again to stop "
                         "at once)")

    def agreed(self, dist: Dist) -> str | None:
        """Collective: the signal that stops the run after this step (any rank's), or None to go on."""
        if dist.world_size == 1:
            return self.signal_name
        flags = torch.tensor([0.0 if self.signal_name is None else float(SIGNALS.index(
            signal.Signals[self.signal_name]) + 1)])
        dist.all_reduce_max(flags)
        return None if flags.item() == 0 else signal.Signals(SIGNALS[int(flags.item()) - 1]).name


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Catch SIGTERM and SIGUSR1 while the run lasts, then restore the previous handlers. Off the main thread
    (where Python cannot install handlers) the request never fires and signals act as before."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._handle) for s in SIGNALS}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
