"""Run untrusted Python (a model's completion) in a separate, confined process — never in the training process.

``run_python(code)`` starts ``sys.executable -I -S -B`` on ``sandbox_runner.py`` with an empty environment,
in a new session (its own process group), with a fresh temporary folder as its working directory, and
waits at most ``wall_s`` seconds; then the whole process group is killed and the folder deleted, whatever
happened. Inside, before the code runs, the runner confines itself in layers (see ``sandbox_runner``):
a new network namespace, Landlock file and TCP rules, resource limits (CPU time, address space, file size,
open files), a seccomp filter against process creation, sockets and other escape hatches, and a Python audit
hook that refuses the same things (and file access outside the folder) with a clear PermissionError. The
kernel layers are used where the kernel offers them (``sandbox_layers()`` says which); the audit hook and
the resource limits are always there.

What the sandbox does not promise: the audit hook is a Python-level guard, and native code (a C extension
the program manages to load) is only stopped by the kernel layers; where those are missing, such code could
read files, open connections or start processes. Nor does it protect a reward from a program written to
game its tests: the tests run in the same interpreter as the program, which can inspect and patch them.
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

# Defaults for code-execution rewards. A recipe cannot set these yet (reward.* has no sandbox keys): a user who
# needs other limits binds them in their own reward function with grpo_ds.rewards.code_exec.make_code_exec.
DEFAULT_WALL_S = 10.0  # wall-clock seconds per program
DEFAULT_CPU_S = 10  # CPU seconds per program (RLIMIT_CPU)
DEFAULT_MEMORY_MB = 1024  # address space per program (RLIMIT_AS), MiB
FILE_LIMIT_MB = 16  # largest file the program may write, its stdout and stderr included (RLIMIT_FSIZE), MiB
OPEN_FILES_LIMIT = 64  # RLIMIT_NOFILE
NPROC_MARGIN = 32  # non-root only: threads the program may add to the user's count (RLIMIT_NPROC)
OUTPUT_LIMIT_BYTES = 64 * 1024  # stdout and stderr kept per program (the rest is read and dropped)

# Read-only for the program's native side (the dynamic loader): shared libraries the standard library's
# extension modules load. The audit hook allows Python-level reads beneath the standard library only.
_LIB_PATHS = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache"]

Status = Literal["ok", "timeout", "memory", "error", "blocked"]


@dataclass(frozen=True)
class SandboxResult:
    """What one program did. ``status``: ok (it finished, exit code 0), timeout (wall or CPU limit), memory
    (out of address space), blocked (it tried something the sandbox forbids, even if it caught the error),
    error (anything else: an exception, a non-zero exit, a crash). ``returncode`` is the process's."""

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
    audit_hook: bool = True,
    report_layers: bool = False,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` of a confined Python process and say what happened.

    ``stdin`` is the program's standard input. ``wall_s`` bounds the wall-clock time, ``cpu_s`` the CPU time
    (whole seconds, rounded up), ``memory_mb`` the address space. ``audit_hook=False`` leaves only the kernel
    layers, to test them; ``report_layers`` writes the layers in use to the start of stderr. Thread-safe: each
    call has its own folder and process.
    """
    if wall_s <= 0 or cpu_s <= 0 or memory_mb <= 0:
        raise ValueError(f"limits must be positive, got wall_s={wall_s}, cpu_s={cpu_s}, memory_mb={memory_mb}")
    with tempfile.TemporaryDirectory(prefix="grpo_ds_sandbox_") as root:
        work = os.path.join(root, "work")  # the program's folder; root keeps what the program must not see
        os.mkdir(work)
        config = {
            "code_path": os.path.join(root, "code.py"),
            "work": os.path.realpath(work),
            "read_dirs": _stdlib_dirs(),
            "lib_paths": _LIB_PATHS,
            "cpu_s": max(1, int(-(-cpu_s // 1))),
            "memory_mb": int(memory_mb),
            "file_mb": FILE_LIMIT_MB,
            "nofile": OPEN_FILES_LIMIT,
            "nproc_margin": NPROC_MARGIN,
            "audit_hook": audit_hook,
            "report_layers": report_layers,
        }
        paths = {name: os.path.join(root, name) for name in ("config.json", "stdin", "stdout", "stderr")}
        with open(config["code_path"], "w", encoding="utf-8") as f:
            f.write(code)
        with open(paths["config.json"], "w") as f:
            json.dump(config, f)
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(stdin)
        with (
            open(paths["stdin"], "rb") as fin,
            open(paths["stdout"], "wb") as fout,
            open(paths["stderr"], "wb") as ferr,
        ):
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-X", "utf8", sandbox_runner.__file__, paths["config.json"]],
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=work,
                env={"TMPDIR": work, "HOME": work},
                start_new_session=True,
                close_fds=True,
            )
            timed_out = not _wait_unreaped(proc.pid, wall_s)
            _kill_group(proc.pid)  # before reaping: the group's id cannot have been reused yet
            returncode = proc.wait()
        stdout, stderr = _read(paths["stdout"]), _read(paths["stderr"])
    if returncode == sandbox_runner.EXIT_SETUP:
        raise SandboxSetupError(stderr.strip().splitlines()[-1] if stderr.strip() else "the sandbox runner failed")
    return SandboxResult(_status(returncode, timed_out), stdout, stderr, returncode)


@functools.lru_cache(maxsize=1)
def sandbox_layers() -> dict[str, str]:
    """Which confinement layers this machine gives a sandboxed program, e.g. ``{"landlock": "on (ABI 7, ...)"}``."""
    result = run_python("", wall_s=10.0, report_layers=True)
    for line in result.stderr.splitlines():
        if line.startswith("sandbox layers: "):
            return json.loads(line.removeprefix("sandbox layers: "))
    raise SandboxSetupError(f"the sandbox did not report its layers: {result.stderr.strip()[-300:]}")


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
    """Wait until ``pid`` exits, without reaping it; False if it is still running after ``timeout_s``."""
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
