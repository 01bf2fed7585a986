"""Stopping on a signal: a preemption or a Ctrl-C ends the run at the next step boundary with a
checkpoint, and never later than ``run.preempt_grace_s`` after the signal.

SLURM, Kubernetes and spot instances send SIGTERM and kill a few seconds later: SLURM after its
``KillWait`` (30 s by default), Kubernetes after ``terminationGracePeriodSeconds`` (30 s),
DeepSpeed's launcher 30 s after it forwards the signal to each rank. SLURM can also send SIGUSR1
ahead of the time limit (``#SBATCH --signal=USR1@120``). A terminal's Ctrl-C sends SIGINT to the
command and, under the ``deepspeed`` launcher, to every rank.

The first SIGTERM, SIGUSR1 or SIGINT is a request: a rank only records it, so a checkpoint being
written when it arrives is finished. At the end of every step the ranks agree (a rank that got no
signal follows the ones that did), write a checkpoint of that step unless the schedule just wrote
one, and stop: exit code ``EXIT_PREEMPTED`` (75) for SIGTERM and SIGUSR1, ``EXIT_INTERRUPTED`` (130,
what shells expect of Ctrl-C) for SIGINT. The same command then resumes from that checkpoint. Called
as ``grpo_ds.train(...)`` (a notebook), a SIGINT reaches the caller as ``KeyboardInterrupt`` after
the checkpoint.

The request has a deadline, ``run.preempt_grace_s`` after the first signal. A step that waits on
something slow (a hanging reward function, a long generation, a stalled collective) would otherwise
keep the run past the scheduler's grace and into its SIGKILL. ``ABANDON_LEAD_S`` before the deadline
(halfway to it, for a grace under twice that) a rank that has not stopped abandons its step: it
kills every process it started during the run (reward workers and whatever they started, each in its
own process group) and exits with the request's code, naming the checkpoint the run resumes from.
Nothing of the abandoned step was written as finished: a checkpoint being written is left under its
temporary name (the next start removes it), and the metrics the step did not log are not there, so
the resume redoes the steps after that checkpoint as an uninterrupted run does them. vLLM runs
inside the rank's process (grpo_ds.rollout.vllm) and goes with it. Every rank keeps its own
deadline, so a multi-rank run ends on every rank whichever of them is stuck. In a notebook the
abandoned step ends in ``StepAbandoned`` (a ``KeyboardInterrupt``) instead of an exit, and the
kernel lives on.

A second signal stops at once: any SIGINT after a request, or a SIGTERM more than
``REPEAT_WINDOW_S`` after the first (SIGTERMs within the window count as one request: a signal sent
to the whole process group, ``kill -TERM -PGID`` or SLURM's ``scancel``, reaches each rank directly
and, moments later, again through DeepSpeed's launcher). The processes the run started are killed,
and the rank exits without a traceback: 130 for SIGINT, 143 (128 + SIGTERM, what a shell shows for a
process SIGTERM killed) for SIGTERM. Checkpoints are written atomically, so the newest complete one
stays usable. SIGUSR1 never stops at once. A process that started with SIGINT ignored (a background
job of a non-interactive shell) keeps ignoring it.

A signal is read by a thread of its own (``signal.set_wakeup_fd``), not by Python's handler: that
handler runs only when the main thread next runs Python code, which a rank waiting in a collective
for the rank that hangs would not do before the deadline. When it does run, the handler waits (up to
``NOTICE_WAIT_S``) until the listening thread has taken the request, so that the main thread's next
line sees it: a split placement's rollout rank sends the stop with the batch it finishes after the
signal, not with a later one whenever the listening thread was slow to be scheduled.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from grpo_ds.config.recipe import RunConfig
from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import Dist

# sysexits.h EX_TEMPFAIL: "a temporary failure; the same command may be retried"
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: how shells report a command that Ctrl-C stopped
REPEAT_WINDOW_S = 5.0
# the most Python's handler waits for the listening thread to take a signal (it takes ~ms)
NOTICE_WAIT_S = 2.0
# the abandoned step's rank starts leaving this long before the deadline, and is gone by it: ~10 ms
# on an idle CPU machine, but a loaded one (CI's two test workers) has taken over 1 s, and a GPU
# process's teardown takes longer
ABANDON_LEAD_S = 3.0
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def exit_code(signal_name: str) -> int:
    """The exit code of a run stopped by ``signal_name``: 130 for SIGINT, 75 otherwise."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


def stop_word(signal_name: str) -> str:
    """How the run's last line names a stop: "interrupted" (Ctrl-C) or "preempted"."""
    return "interrupted" if signal_name == "SIGINT" else "preempted"


def _resume_hint(checkpoint: str | None) -> str:
    where = (
        f"the checkpoint {checkpoint}"
        if checkpoint
        else "the start (no checkpoint was written yet)"
    )
    return f"the same command resumes from {where}"


class Preempted(Exception):
    """The run stopped early on a signal, after ``step``; ``checkpoint`` is the checkpoint to resume
    from."""

    def __init__(
        self, signal_name: str, step: int, total_steps: int, checkpoint: str | None
    ) -> None:
        self.signal_name, self.step, self.total_steps, self.checkpoint = (
            signal_name,
            step,
            total_steps,
            checkpoint,
        )
        super().__init__(str(self))

    @property
    def exit_code(self) -> int:
        return exit_code(self.signal_name)

    def __str__(self) -> str:
        where = (
            f"the checkpoint {self.checkpoint}"
            if self.checkpoint
            else "no checkpoint (the step's weights were not finite; the previous checkpoint stays)"
        )
        return (
            f"stopped by {self.signal_name} after step {self.step} of {self.total_steps}: {where}. "
            "Run the same command to resume"
        )


class StepAbandoned(KeyboardInterrupt):
    """A run called from Python (a notebook) whose step did not end within run.preempt_grace_s of a
    stop signal, or that got a second Ctrl-C: the step was dropped, and the message names the
    checkpoint to resume from. A KeyboardInterrupt, so that no ``except Exception`` on the way (a
    reward function's guard) takes it for an error of its own."""


class StopRequest:
    """What this process has been asked: nothing, or to stop at the next step boundary (by which
    signal), and by when. ``leave_process``: a command-line run leaves by ``os._exit`` when it
    abandons a step; a run called from Python raises StepAbandoned in the caller's thread
    instead."""

    def __init__(self, leave_process: bool = True) -> None:
        self.signal_name: str | None = None
        self.grace_s: float = RunConfig.preempt_grace_s  # the recipe's, once it is read (set_grace)
        self.leave_process = leave_process
        self.run_dir: Path | None = None  # where the checkpoints are (track)
        self.step: int | None = None  # the step in progress (track)
        self._first: float | None = None  # when the request came
        self._first_term: float | None = None
        self._ended = threading.Event()  # the run returned or raised: no deadline any more
        # a Python caller's thread is being stopped with this message
        self._abandoning: str | None = None
        # the listening thread has taken a signal (_handle waits for it)
        self._noticed = threading.Event()
        self._children_before: set[int] = _children()

    def set_grace(self, grace_s: float) -> None:
        """The recipe's run.preempt_grace_s (a request that came before the recipe was read keeps
        its start)."""
        self.grace_s = grace_s

    def track(self, run_dir: Path, step: int | None) -> None:
        """The run folder, and the step now running (None between steps): what an abandoned step
        names."""
        self.run_dir, self.step = run_dir, step

    def _handle(self, _signum: int, _frame) -> None:
        """The Python-level handler, run by the main thread whenever it next runs Python code: it
        stops a Python caller's thread (see _abandon), and otherwise waits until the listening
        thread has taken the signal, so that the main thread's code after it sees the request. The
        signal itself is read by the listening thread (a main thread blocked in a collective or in
        C++ code would run this handler too late)."""
        if self._abandoning is not None:
            raise StepAbandoned(self._abandoning)
        self._noticed.wait(NOTICE_WAIT_S)

    def _listen(self, wakeup: int) -> None:
        """The listening thread: each caught signal's number arrives on ``wakeup``
        (signal.set_wakeup_fd), written by the C-level handler whatever the main thread is doing."""
        with os.fdopen(wakeup, "rb", buffering=0) as pipe:
            while numbers := pipe.read(64):
                for signum in numbers:
                    if signum in SIGNALS and self._abandoning is None:
                        self._received(signum)

    def _received(self, signum: int) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signal_name is not None and (
            signum == signal.SIGINT
            or (
                signum == signal.SIGTERM
                and self._first_term is not None
                and now - self._first_term > REPEAT_WINDOW_S
            )
        ):
            self._stop_now(signum)
            return
        if signum == signal.SIGTERM:
            self._first_term = self._first_term or now
        if self.signal_name is None:
            self.signal_name, self._first = name, now
            again = "Ctrl-C again" if signum == signal.SIGINT else "send SIGTERM again"
            launcher.say(
                f"received {name}: stopping after this step with a checkpoint, within "
                f"run.preempt_grace_s={self.grace_s:g}s ({again} to stop at once)"
            )
            threading.Thread(
                target=self._watch, name="grpo_ds-preempt-deadline", daemon=True
            ).start()
        self._noticed.set()

    def agreed(self, dist: Dist) -> str | None:
        """Collective: the signal that stops the run after this step (any rank's), or None to go
        on."""
        if dist.world_size == 1:
            return self.signal_name
        flags = torch.tensor(
            [
                0.0
                if self.signal_name is None
                else float(SIGNALS.index(signal.Signals[self.signal_name]) + 1)
            ]
        )
        dist.all_reduce_max(flags)
        return None if flags.item() == 0 else signal.Signals(SIGNALS[int(flags.item()) - 1]).name

    # ---- past the request: the deadline, and a second signal

    def _watch(self) -> None:
        """The deadline's thread: wait for the run to end, or abandon its step ABANDON_LEAD_S before
        the deadline (halfway to a short one; re-read every half second: the recipe's grace may
        arrive after the signal)."""
        while True:
            left = (
                self._first
                + self.grace_s
                - min(ABANDON_LEAD_S, self.grace_s / 2)
                - time.monotonic()
            )
            if left <= 0:
                break
            if self._ended.wait(min(left, 0.5)):
                return
        self._abandon()

    def _where(self) -> str:
        # checkpoint imports what imports this module
        from grpo_ds.run.checkpoint import CHECKPOINTS, latest_name

        if self.run_dir is None:
            return "the same command starts the run again"
        name = latest_name(self.run_dir)
        return _resume_hint(str(self.run_dir / CHECKPOINTS / name) if name else None)

    def _abandon(self) -> None:
        step = f"step {self.step}" if self.step is not None else "the run's start-up or its end"
        self._leave_now(
            f"stopped by {self.signal_name}: {step} did not end within run.preempt_grace_s="
            f"{self.grace_s:g}s and was abandoned; {self._where()}",
            exit_code(self.signal_name),
            f"{stop_word(self.signal_name)}: ",
        )

    def _stop_now(self, signum: int) -> None:
        """A second signal: end the processes the run started, and stop without finishing the
        step."""
        name = signal.Signals(signum).name
        self._leave_now(
            f"stopped at once by a second {name}: the step "
            f"in progress was dropped; {self._where()}",
            128 + signum,
        )

    def _leave_now(self, message: str, code: int, prefix: str = "") -> None:
        """From the listening or the deadline's thread: end the processes the run started, and leave
        with ``code`` (a command-line run), or raise StepAbandoned in the caller's thread (a run
        called from Python: its sleep or wait is cut short by the SIGINT sent to it). A second
        SIGTERM always leaves: it means the process."""
        if (
            not self.leave_process
            and code != 128 + signal.SIGTERM
            and signal.getsignal(signal.SIGINT) == self._handle
        ):
            self._abandoning = message
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            _end_children(self._children_before)
            return
        launcher.say(prefix + message)
        _end_children(self._children_before)
        _leave(code)

    def end(self) -> None:
        self._ended.set()


RUNNER_POLL_S = 0.2  # how often the first rank of a node looks whether the command is still there


def watch_the_launch(request: StopRequest) -> None:
    """A one-node `deepspeed` launch: the command the user started (DeepSpeed's runner) forwards no
    signal on one node (deepspeed/launcher/runner.py does for multi-node launches only), so a
    SIGTERM to it alone (``kill PID``, a container runtime's stop) ends it and leaves its per-node
    launcher (deepspeed.launcher.launch) and the ranks running. The node's first rank watches: once
    the runner is gone (the launcher has another parent), or the ``python -m grpo_ds.launch``
    command in front of it (grpo_ds/launch.py) is, it sends every rank of the node the SIGTERM that
    was not forwarded, and they stop after the step with its checkpoint. The ranks, not DeepSpeed's
    launcher, which would SIGTERM every process under them (a reward function's helper too).
    Elsewhere (one process, a multi-node launch) nothing is watched."""
    if not launcher.launched() or launcher.local_rank() != 0:
        return
    try:
        node_launcher = psutil.Process().parent()
        runner = node_launcher.parent() if node_launcher is not None else None
        if runner is None or launcher.NODE_LAUNCHER not in " ".join(node_launcher.cmdline()):
            return
        if "deepspeed" not in " ".join(runner.cmdline()):
            return
        front = _the_launch_command()
    except psutil.Error:
        return

    def gone() -> bool:
        return node_launcher.ppid() != runner.pid or (front is not None and not front.is_running())

    def watch() -> None:
        while not request._ended.wait(RUNNER_POLL_S):
            try:
                if gone():
                    for rank in node_launcher.children():
                        rank.send_signal(signal.SIGTERM)
                    return
            except psutil.Error:  # the launcher itself is gone: nothing to tell
                return

    threading.Thread(target=watch, name="grpo_ds-launch-watch", daemon=True).start()


def _the_launch_command() -> psutil.Process | None:
    """The ``python -m grpo_ds.launch`` process this rank runs under, if any."""
    pid = os.environ.get(launcher.LAUNCH_PID_VAR)
    if not pid:
        return None
    try:
        return psutil.Process(int(pid))
    except (psutil.Error, ValueError):
        return None


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _end_children(before: set[int]) -> None:
    """SIGKILL every process this one started since ``before`` was taken, with the process group of
    each that leads one (a reward worker leads its own, so whatever it started goes too)."""
    for child in psutil.Process().children(recursive=True):
        if child.pid in before:
            continue
        try:
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)
            child.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


def _leave(code: int) -> None:
    """Exit now, from any thread, without the interpreter's teardown (which could wait on the stuck
    step)."""
    launcher.record_exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@contextmanager
def stop_on_signals(leave_process: bool = True) -> Iterator[StopRequest]:
    """Catch SIGTERM, SIGUSR1 and SIGINT while the run lasts, then restore the previous handlers
    (SIGINT only where it was not ignored). Off the main thread (where Python cannot install
    handlers) the request never fires and signals act as before. ``leave_process``: see
    StopRequest."""
    request = StopRequest(leave_process)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(
        target=request._listen, args=(read,), name="grpo_ds-stop-signals", daemon=True
    ).start()
    caught = [s for s in SIGNALS if s != signal.SIGINT or signal.getsignal(s) != signal.SIG_IGN]
    previous = {s: signal.signal(s, request._handle) for s in caught}
    watch_the_launch(request)
    try:
        yield request
    # a Python caller gets a Ctrl-C back as KeyboardInterrupt, after the checkpoint
    except Preempted as stopped:
        if leave_process or stopped.signal_name != "SIGINT":
            raise
        launcher.say(f"{stop_word(stopped.signal_name)}: {stopped}")
        raise KeyboardInterrupt(str(stopped)) from stopped
    finally:
        if not leave_process:  # a Python caller goes on: no deadline may fire in its later work
            request.end()
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_wakeup)
        os.close(write)  # the listening thread reads to the end and stops
