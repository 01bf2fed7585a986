"""One owner per run folder: a lock file, taken before anything is written and released when the run
ends.

The lock is ``<run folder>/run.lock``, made with ``O_CREAT | O_EXCL``, which creates a file
atomically, failing if it exists, on local disks and on the shared file systems clusters use (NFSv3
and later, Lustre, GPFS, BeeGFS). It holds the holder's host, pid, the process's start time and when
the run started. No ``flock``/``fcntl`` lock is used: those are optional on Lustre (``-o flock``)
and emulated, with leases, on NFS.

While it runs, the holder touches the file every ``HEARTBEAT_S`` seconds, from a thread, so a long
step is not mistaken for a dead run. A second launch finds the file and stops with one line naming
the holder, touching nothing.

A lock left behind never needs a hand to clear it:
- when its holder ran on this host and that process is gone (SIGKILL, a crash), the next launch
  takes it over at once; the process start time stored in the file tells a reused pid from the
  holder;
- when it ran on another host (a lost node), the lock is taken over once its heartbeat is older than
  ``STALE_S``.
Taking over renames the stale file away first. A rename succeeds once, so two launches racing for a
stale lock cannot both win. A file system without atomic exclusive create (NFSv2) cannot keep two
launches apart; nothing else is lost there.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_ds.errors import UserError

LOCK = "run.lock"
HEARTBEAT_S = 30.0  # the holder touches the lock this often
STALE_S = 300.0  # a lock from another host whose heartbeat is older than this is a dead run's


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    # this process's start time, from /proc (tells a reused pid apart); "" where unknown
    process_start: str
    started: str  # when the run took the lock, ISO 8601 UTC

    @staticmethod
    def me() -> Holder:
        return Holder(
            socket.gethostname(),
            os.getpid(),
            _process_start(os.getpid()),
            datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        )


class RunLock:
    """The lock of one run folder, held from ``acquire`` to ``release``."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK
        self.holder = Holder.me()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise UserError naming the live holder. A dead holder's lock is taken
        over."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a takeover races with another launch at most once or twice
            if self._create():
                self._beat = threading.Thread(
                    target=self._heartbeat, name="grpo_ds-run-lock", daemon=True
                )
                self._beat.start()
                return
            found = self._read_settled()
            if found is not None and not self._dead(found):
                age = time.time() - self.path.stat().st_mtime if self.path.exists() else 0.0
                raise UserError(
                    "run.name",
                    f"the run folder {self.path.parent} is in use by another launch (host "
                    f"{found.host}, pid {found.pid}, started {found.started}, last heartbeat "
                    f"{age:.0f} s ago)",
                    "wait for it to end, or choose another run.name; a lock whose holder has died "
                    "is taken over by itself (on another host "
                    f"after {STALE_S:.0f} s without a heartbeat)",
                )
            self._take_over()
        raise UserError("run.name", f"could not take the lock {self.path}", "try again")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (idempotent)."""
        self._stop.set()
        if read_holder(self.path) == self.holder:
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(vars(self.holder), f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read_settled(self) -> Holder | None:
        """The holder in the lock file; a file without one for a few seconds (a launch that died
        while writing it) is None. A file just created by another launch gets the moment its holder
        needs to write it."""
        for _ in range(20):
            found = read_holder(self.path)
            try:
                young = time.time() - self.path.stat().st_mtime < 5.0
            except FileNotFoundError:
                return None
            if found is not None or not young:
                return found
            time.sleep(0.25)
        return read_holder(self.path)

    def _dead(self, found: Holder) -> bool:
        if found.host == self.holder.host:
            start = _process_start(found.pid)
            if start is None:  # no such process
                return True
            if start == "":  # no /proc: whether the pid is alive is all we can tell
                return not _alive(found.pid)
            return start != found.process_start  # the pid now names another process
        try:
            return time.time() - self.path.stat().st_mtime > STALE_S
        except FileNotFoundError:
            return True

    def _take_over(self) -> None:
        try:
            os.rename(
                self.path, self.path.with_name(f"{LOCK}.stale-{self.holder.host}-{self.holder.pid}")
            )
        except FileNotFoundError:
            return  # another launch moved it first; the next exclusive create decides
        for stale in self.path.parent.glob(f"{LOCK}.stale-*"):
            stale.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                # a write that fails is the run's to report (grpo_ds.run.writes); the lock just ages
                pass


def read_holder(path: Path) -> Holder | None:
    """The holder named in a lock file, None when there is none (or it is torn: a crash while it was
    written)."""
    try:
        return Holder(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat); None when
    there is no such process, "" where /proc does not say (another OS)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]
