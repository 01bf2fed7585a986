"""Run untrusted Python (a model's completion) in a separate, confined process — never in the
training process.

``run_python(code)`` starts ``sys.executable -I -S -B`` on ``sandbox_runner.py`` with an empty
environment, in a new session (its own process group), with a fresh temporary folder as its working
directory, and waits at most ``wall_s`` seconds; then the whole process group is killed and the
folder deleted, whatever happened. Inside, before the code runs, the runner confines itself in
layers (see ``sandbox_runner``): a new network namespace, a size-limited folder (a tmpfs of
``disk_mb``), Landlock file and TCP rules, resource limits (CPU time, address space, file size, open
files), a seccomp filter against process creation, sockets and other escape hatches, and a Python
audit hook that refuses the same things (and file access outside the folder) with a clear
PermissionError. The kernel layers are used where the kernel offers them (``sandbox_layers()`` says
which); the audit hook and the resource limits are always there.

Disk. ``disk_mb`` bounds what a program writes, all files together (RLIMIT_FSIZE bounds one file
only; a program could otherwise write 16 MiB x as many files as it likes). Two layers: where the
kernel allows a private mount namespace, the folder is a tmpfs of ``disk_mb`` MiB and
``FILES_LIMIT`` inodes, so no byte beyond it is ever stored (whether in many files, deleted-but-open
files, mmap or fallocate) and nothing reaches the disk; and always, the parent checks every
``WATCH_S`` seconds, and once more at the exit, the bytes the process has passed to write() in total
(/proc/PID/io ``wchar``: deleting and rewriting counts again), the space its folder holds and the
files in it (a real folder, where there is no tmpfs), and the files it holds open after deleting
them; past the bound it is killed. Either way the result is ``blocked`` (a tmpfs filled to within
1 MiB of its size counts as reached, since a program may catch the ENOSPC). The tmpfs lives in
memory: up to ``disk_mb`` per running program.

What the sandbox does not promise: the audit hook is a Python-level guard, and native code (a C
extension the program manages to load) is only stopped by the kernel layers; where those are
missing, such code could read files, open connections or start processes. Nor does it protect a
reward from a program written to game its tests: the tests run in the same interpreter as the
program, which can inspect and patch them.
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from grpo_ds.rewards import sandbox_runner

# Defaults for code-execution rewards. A recipe cannot set these yet (reward.* has no sandbox keys):
# a user who needs other limits binds them in their own reward function with
# grpo_ds.rewards.code_exec.make_code_exec.
DEFAULT_WALL_S = 10.0  # wall-clock seconds per program
DEFAULT_CPU_S = 10  # CPU seconds per program (RLIMIT_CPU)
DEFAULT_MEMORY_MB = 1024  # address space per program (RLIMIT_AS), MiB
# largest file the program may write, its stdout and stderr included (RLIMIT_FSIZE), MiB
FILE_LIMIT_MB = 16
OPEN_FILES_LIMIT = 64  # RLIMIT_NOFILE
NPROC_MARGIN = 32  # non-root only: threads the program may add to the user's count (RLIMIT_NPROC)
OUTPUT_LIMIT_BYTES = 64 * 1024  # stdout and stderr kept per program (the rest is read and dropped)
# what a program may write in total, all its files together (and stdout/stderr), MiB
DEFAULT_DISK_MB = 64
FILES_LIMIT = 4096  # files and folders a program may create in its folder
WATCH_S = 0.01  # how often the parent checks what a running program has written

# Read-only for the program's native side (the dynamic loader): shared libraries the standard
# library's extension modules load. The audit hook allows Python-level reads beneath the standard
# library only.
_LIB_PATHS = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache"]

Status = Literal["ok", "timeout", "memory", "error", "blocked"]


@dataclass(frozen=True)
class SandboxResult:
    """What one program did. ``status``: ok (it finished, exit code 0), timeout (wall or CPU limit),
    memory (out of address space), blocked (it tried something the sandbox forbids, even if it
    caught the error), error (anything else: an exception, a non-zero exit, a crash). ``returncode``
    is the process's."""

    status: Status
    stdout: str
    stderr: str
    returncode: int


class SandboxSetupError(RuntimeError):
    """The sandbox could not be set up on this machine (not the program's fault)."""


def run_python(
    code: str,
    *,
    stdin: str = "",
    wall_s: float = DEFAULT_WALL_S,
    cpu_s: float = DEFAULT_CPU_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    disk_mb: int = DEFAULT_DISK_MB,
    audit_hook: bool = True,
    report_layers: bool = False,
    size_limited_folder: bool = True,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` of a confined Python process and say what happened.

    ``stdin`` is the program's standard input. ``wall_s`` bounds the wall-clock time, ``cpu_s`` the
    CPU time (whole seconds, rounded up), ``memory_mb`` the address space, ``disk_mb`` what it
    writes in total (see the module docstring). ``audit_hook=False`` leaves only the kernel layers,
    to test them, ``size_limited_folder=False`` only the parent's watch of the disk;
    ``report_layers`` writes the layers in use to the start of stderr. Thread-safe: each call has
    its own folder and process.
    """
    if wall_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or disk_mb <= 0:
        raise ValueError(
            f"limits must be positive, got wall_s={wall_s}, cpu_s={cpu_s}, memory_mb={memory_mb}, "
            f"disk_mb={disk_mb}"
        )
    with tempfile.TemporaryDirectory(prefix="grpo_ds_sandbox_") as root:
        # the program's folder; root keeps what the program must not see
        work = os.path.join(root, "work")
        os.mkdir(work)
        config = _runner_config(
            root,
            work,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            disk_mb=int(disk_mb) if size_limited_folder else 0,  # 0: no tmpfs
            audit_hook=audit_hook,
            report_layers=report_layers,
        )
        paths = _write_inputs(root, config, code, stdin)
        returncode, timed_out, overrun = _start_and_wait(
            paths, work, wall_s, config["work"], int(disk_mb) << 20
        )
        stdout, stderr = _read(paths["stdout"]), _read(paths["stderr"])
    if returncode == sandbox_runner.EXIT_SETUP:
        raise SandboxSetupError(
            stderr.strip().splitlines()[-1] if stderr.strip() else "the sandbox runner failed"
        )
    if overrun is not None:
        return SandboxResult(
            "blocked", stdout, f"{stderr}\nsandbox: blocked {overrun}\n", returncode
        )
    return SandboxResult(_status(returncode, timed_out), stdout, stderr, returncode)


def _runner_config(
    root: str,
    work: str,
    *,
    cpu_s: float,
    memory_mb: int,
    disk_mb: int,
    audit_hook: bool,
    report_layers: bool,
) -> dict:
    """The runner's CONFIG.json (``sandbox_runner`` reads these keys): the program's path, its
    folder, what it may read and its limits."""
    return {
        "code_path": os.path.join(root, "code.py"),
        "work": os.path.realpath(work),
        "read_dirs": _stdlib_dirs(),
        "lib_paths": _LIB_PATHS,
        "cpu_s": max(1, int(-(-cpu_s // 1))),
        "memory_mb": int(memory_mb),
        "disk_mb": disk_mb,
        "max_files": FILES_LIMIT,
        "file_mb": FILE_LIMIT_MB,
        "nofile": OPEN_FILES_LIMIT,
        "nproc_margin": NPROC_MARGIN,
        "audit_hook": audit_hook,
        "report_layers": report_layers,
    }


def _write_inputs(root: str, config: dict, code: str, stdin: str) -> dict[str, str]:
    """Write the program, the runner's config and the program's stdin beneath ``root`` (outside
    the program's folder); return the paths of those and of its stdout and stderr."""
    paths = {
        name: os.path.join(root, name) for name in ("config.json", "stdin", "stdout", "stderr")
    }
    with open(config["code_path"], "w", encoding="utf-8") as f:
        f.write(code)
    with open(paths["config.json"], "w") as f:
        json.dump(config, f)
    with open(paths["stdin"], "w", encoding="utf-8") as f:
        f.write(stdin)
    return paths


def _start_and_wait(
    paths: dict[str, str], cwd: str, wall_s: float, work: str, limit: int
) -> tuple[int, bool, str | None]:
    """Start the runner in a new session, in ``cwd`` with a cleared environment; wait for it while
    watching what it writes to ``work``; then kill its process group and reap it: (exit code,
    timed out, what it overran or None)."""
    with (
        open(paths["stdin"], "rb") as fin,
        open(paths["stdout"], "wb") as fout,
        open(paths["stderr"], "wb") as ferr,
    ):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-B",
                "-X",
                "utf8",
                sandbox_runner.__file__,
                paths["config.json"],
            ],
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=cwd,
            env={"TMPDIR": cwd, "HOME": cwd},
            start_new_session=True,
            close_fds=True,
        )
        timed_out, overrun = _wait_watching(proc.pid, wall_s, work, limit)
        _kill_group(proc.pid)  # before reaping: the group's id cannot have been reused yet
        return proc.wait(), timed_out, overrun


@functools.lru_cache(maxsize=1)
def sandbox_layers() -> dict[str, str]:
    """Which confinement layers this machine gives a sandboxed program, e.g.
    ``{"landlock": "on (ABI 7, ...)"}``."""
    result = run_python("", wall_s=10.0, report_layers=True)
    for line in result.stderr.splitlines():
        if line.startswith("sandbox layers: "):
            return json.loads(line.removeprefix("sandbox layers: "))
    raise SandboxSetupError(
        f"the sandbox did not report its layers: {result.stderr.strip()[-300:]}"
    )


def _status(returncode: int, timed_out: bool) -> Status:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL: the hard CPU limit
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == sandbox_runner.EXIT_MEMORY:
        return "memory"
    if returncode == sandbox_runner.EXIT_BLOCKED:
        return "blocked"
    return "error"


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")})


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` exits, without reaping it; False if it is still running after
    ``timeout_s``."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3 or Python built without it: poll
        deadline, pause = time.monotonic() + timeout_s, 0.001
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(pidfd)


def _wait_watching(pid: int, wall_s: float, work: str, limit: int) -> tuple[bool, str | None]:
    """Wait (unreaped) until the program exits or ``wall_s`` passes, checking what it has written
    every WATCH_S seconds and once more after it exits: (timed out, what it overran or None)."""
    deadline = time.monotonic() + wall_s
    while True:
        left = deadline - time.monotonic()
        exited = left > 0 and _wait_unreaped(pid, min(WATCH_S, left))
        overrun = _disk_overrun(pid, work, limit)
        if overrun is not None or exited:
            return False, overrun
        if time.monotonic() >= deadline:
            return True, None


def _disk_overrun(pid: int, work: str, limit: int) -> str | None:
    """Why the program is over the disk bound, or None: bytes written in total, bytes held (the
    folder's allocated blocks and files it deleted but holds open), or files created."""
    mib = limit >> 20
    try:
        # the whole process (every thread, reaped children), unreaped
        with open(f"/proc/{pid}/io") as f:
            written = next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
        if written > limit:
            return f"writing {written / 2**20:.0f} MiB (the limit is {mib} MiB in total)"
    except (OSError, StopIteration, ValueError):
        pass  # gone (reaped) or not readable here: the other measures still hold
    held, entries, stack = 0, 0, [work]
    while stack and entries <= FILES_LIMIT:
        try:
            with os.scandir(stack.pop()) as folder:
                for entry in folder:
                    entries += 1
                    stat = entry.stat(follow_symlinks=False)
                    held += stat.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue  # changed while we looked: the next check sees it
    held += _deleted_open_bytes(pid)
    if _tmpfs_full(pid, work, limit):
        return f"filling its folder (the limit is {mib} MiB and {FILES_LIMIT} files in total)"
    if entries > FILES_LIMIT:
        return f"creating more than {FILES_LIMIT} files in its folder"
    if held > limit:
        return f"holding {held / 2**20:.0f} MiB on disk (the limit is {mib} MiB in total)"
    return None


def _tmpfs_full(pid: int, work: str, limit: int) -> bool:
    """Whether the program's size-limited folder (seen in its own mount namespace) is within 1 MiB
    or 16 files of its bound: the kernel refuses what goes past it, which the program may catch and
    try again."""
    try:
        room = os.statvfs(f"/proc/{pid}/root{work}")
    except OSError:
        return False  # exited, or no access here: the runner checks the same as the program ends
    ours = room.f_blocks * room.f_frsize == limit  # the tmpfs, not the disk under a plain folder
    return ours and (room.f_bavail * room.f_frsize < 2**20 or room.f_favail < 16)


def _deleted_open_bytes(pid: int) -> int:
    """Space held by files the program deleted but keeps open (at most RLIMIT_NOFILE of them)."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            # the open file itself, even when it has no name left
            stat = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.st_nlink == 0:
            total += stat.st_blocks * 512
    return total


def _kill_group(pid: int) -> None:
    """SIGKILL the program's process group (it leads its own session), leftovers included."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read(OUTPUT_LIMIT_BYTES + 1)
    text = data[:OUTPUT_LIMIT_BYTES].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > OUTPUT_LIMIT_BYTES else "")
