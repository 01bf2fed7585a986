"""``python -m grpo_ds.launch ARGS...``: DeepSpeed's ``deepspeed ARGS...`` (the same arguments,
hostfile, environment handling and ``--module``), with a stop that ends the run the way the docs
say, and the run's exit code.

DeepSpeed's runner forwards no signal on one node: a SIGTERM to the ``deepspeed`` command alone
(``kill PID``, a container runtime's stop) ends it at once with 143, and a SIGTERM to its process
group ends it at once too, while the ranks are still writing their checkpoint; whoever waits on the
command sees the run end before it has. This command runs DeepSpeed's runner in a session of its
own and stands in front of it:
- a SIGTERM, SIGUSR1 or SIGINT sent to it or to its process group (a scheduler's stop, a terminal's
  Ctrl-C), each time it comes, is passed to every rank of the node, and to nothing the ranks
  started (a reward helper sees nothing of a stop); a SIGHUP (the terminal closed) as a SIGTERM.
  The ranks stop as grpo_ds/run/preemption.py says: after the step, with its checkpoint, within
  ``run.preempt_grace_s``;
- it returns once every process under it has ended: it is their subreaper (a rank whose
  DeepSpeed launcher ended is still its to wait for), and what is still there once the ranks have
  gone is ended (SIGTERM, then SIGKILL ``LEFTOVER_WAIT_S`` later);
- it returns the ranks' exit code, which each rank records as it leaves (``launcher.EXITS_VAR``;
  ``exit_code`` says how several ranks' codes make one): 75 for a run that stopped with its
  checkpoint, 130 after a Ctrl-C, 2 for a refusal, 0 for a finished run.
If this command itself is killed (SIGKILL), the ranks notice that it is gone and stop as for a
SIGTERM (grpo_ds.run.preemption.watch_the_launch). A launch over several nodes (a hostfile naming
other hosts) has DeepSpeed's runner forward signals itself (over pdsh), and the command passes them
to the runner; its exit code is then the runner's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from grpo_ds.distributed import launcher
from grpo_ds.run.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED

USAGE = (
    "usage: python -m grpo_ds.launch [the deepspeed command's arguments: --num_gpus N, --hostfile "
    "FILE, --master_port PORT, ...] --module grpo_ds.train RECIPE.json [section.key=value ...]\n"
    "(every argument goes to DeepSpeed's launcher unchanged: `deepspeed --help` lists them)"
)
FORWARDED = {
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGUSR1: signal.SIGUSR1,
    signal.SIGINT: signal.SIGINT,
    signal.SIGHUP: signal.SIGTERM,
}
# what ranks exit with when a stop ended them (in order: the most severe last)
STOP_CODES = (EXIT_PREEMPTED, EXIT_INTERRUPTED, 128 + signal.SIGTERM)
POLL_S = 0.2  # how often the ranks under this command are looked for
# once the ranks have gone, what they left behind gets this long between SIGTERM and SIGKILL
LEFTOVER_WAIT_S = 5.0
PR_SET_CHILD_SUBREAPER = 36


def exit_code(recorded: list[int], ranks_seen: int, runner_code: int, signalled: int | None) -> int:
    """The launch's exit code from the codes its ranks recorded (in rank order), how many ranks ran
    on this node, the runner's code (negative: the signal that ended it) and the signal this
    command was sent (None if none):
    - a rank that failed (any code but 0 and a stop's) gives its code, the lowest rank's first;
    - every rank recorded: the most severe stop (143, then 130, then 75), else the runner's code
      where it failed, else 0;
    - a rank that recorded nothing (killed, or a traceback): the stop the others recorded where
      this command was signalled, else the runner's code; with no stop recorded, a signalled
      launch gives 128 + the signal (the ranks were ended before they could stop on it), and a
      runner that returned 0 gives 1 (a rank that ended without a word failed)."""
    failures = [code for code in recorded if code not in (0, *STOP_CODES)]
    if failures:
        return failures[0]
    stops = [code for code in STOP_CODES if code in recorded]
    runner = 128 - runner_code if runner_code < 0 else runner_code
    if len(recorded) >= ranks_seen:
        return stops[-1] if stops else runner
    if signalled is not None:
        return stops[-1] if stops else 128 + signalled
    return runner or 1


class Launch:
    """DeepSpeed's runner under this command: the signals passed on, the ranks found and waited
    for."""

    def __init__(self) -> None:
        self.signalled: int | None = None  # the first signal this command was sent
        self.ranks: dict[int, psutil.Process] = {}  # pid: every rank seen on this node
        self.runner: subprocess.Popen | None = None

    def start(self, args: list[str], exits: Path) -> bool:
        """DeepSpeed's runner with ``args``, unless a signal came first (then False)."""
        if self.signalled is not None:
            return False
        env = {
            **os.environ,
            launcher.EXITS_VAR: str(exits),
            launcher.LAUNCH_PID_VAR: str(os.getpid()),
        }
        self.runner = subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.runner", *args],
            env=env,
            start_new_session=True,  # a signal to this command's group reaches this command alone
        )
        return True

    def find_ranks(self) -> list[psutil.Process]:
        """The ranks under this command: every child DeepSpeed's per-node launcher has started
        (remembered, so that a rank that outlives that launcher is still one); those alive now."""
        try:
            tree = psutil.Process().children(recursive=True)
        except psutil.Error:
            return []
        for process in tree:
            try:
                parent = process.parent()
                if parent is not None and launcher.NODE_LAUNCHER in " ".join(parent.cmdline()):
                    self.ranks.setdefault(process.pid, process)
            except psutil.Error:
                continue
        return self._live_ranks()

    def forward(self, signum: int, _frame=None) -> None:
        """A signal to this command: to every rank of the node; before there are any, or for a
        launch over several nodes, to DeepSpeed's runner."""
        sent = FORWARDED[signal.Signals(signum)]
        if self.signalled is None:
            self.signalled = sent
        ranks = self.find_ranks()
        for rank in ranks:
            try:
                rank.send_signal(sent)
            except psutil.Error:
                pass
        if not ranks and self.runner is not None and self.runner.poll() is None:
            self.runner.send_signal(sent)

    def wait(self) -> int:
        """Reap every process under this command until none is left; the runner's exit code."""
        runner_code: int | None = None
        ranks_gone_at: float | None = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # nothing is left under this command
                break
            if pid == self.runner.pid:
                runner_code = os.waitstatus_to_exitcode(status)
                self.runner.returncode = runner_code
            if pid:
                continue
            live = self.find_ranks()
            if runner_code is not None and not live:
                if ranks_gone_at is None:
                    ranks_gone_at = time.monotonic()
                    self._end_leftovers(signal.SIGTERM)
                elif time.monotonic() - ranks_gone_at > LEFTOVER_WAIT_S:
                    self._end_leftovers(signal.SIGKILL)
            time.sleep(POLL_S)
        return 1 if runner_code is None else runner_code

    def _live_ranks(self) -> list[psutil.Process]:
        live = []
        for rank in list(self.ranks.values()):
            try:
                if rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE:
                    live.append(rank)
            except psutil.Error:
                continue
        return live

    @staticmethod
    def _end_leftovers(sent: int) -> None:
        """Once the runner and the ranks have ended: what is left under this command is ended."""
        try:
            for process in psutil.Process().children(recursive=True):
                process.send_signal(sent)
        except psutil.Error:
            pass


def _become_subreaper() -> None:
    """Linux: the processes under this command whose parent ends become its children, so that it
    can wait for them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip(), flush=True)
        return 0 if args else 2
    _become_subreaper()
    with tempfile.TemporaryDirectory(prefix="grpo_ds-launch-") as folder:
        exits = Path(folder)
        launch = Launch()
        for signum in FORWARDED:  # before the runner starts: no signal may find it unwatched
            signal.signal(signum, launch.forward)
        if not launch.start(args, exits):
            return 128 + launch.signalled
        runner_code = launch.wait()
        recorded = launcher.recorded_exits(exits)
        codes = [recorded[rank] for rank in sorted(recorded)]
        return exit_code(codes, len(launch.ranks), runner_code, launch.signalled)


if __name__ == "__main__":
    sys.exit(main())
