"""Run commands through the real `deepspeed` launcher on CPU (shared by the distributed tests)."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from grpo_ds.distributed.launcher import free_port

REPO = Path(__file__).resolve().parent.parent


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then the parent's pid, the
    process group), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile
        return None


def gone(pid: int) -> bool:
    """Whether the process has ended: a zombie waiting for its parent to reap it, or reaped
    already."""
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"


def clean_env() -> dict:
    """The test process's environment without any process-group variables an in-process run may have
    set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "LOCAL_WORLD_SIZE",
        )
    }
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def deepspeed_program() -> str:
    """The `deepspeed` launcher of the Python running the tests (its environment's bin), else the
    one on PATH."""
    found = Path(sys.executable).parent / "deepspeed"
    return str(found) if found.exists() else "deepspeed"


def launch_command(
    num_ranks: int, args: list, master_port: int, program: str | Path | None = None
) -> list[str]:
    """`deepspeed --num_gpus N --master_port PORT ARGS...` as an argument list: how every test
    launches ranks on one node. ``program`` is another environment's launcher (the vLLM
    environment's), by default ``deepspeed_program()``. The caller draws the port (``free_port()``)
    and removes the launch's shared-memory buffers by it afterwards (``remove_shm_buffers``)."""
    return [
        str(program or deepspeed_program()),
        "--num_gpus",
        str(num_ranks),
        "--master_port",
        str(master_port),
        *map(str, args),
    ]


def deepspeed_launch(num_ranks: int, args: list[str], cwd: Path = REPO, timeout: int = 600) -> str:
    """`deepspeed --num_gpus N ARGS...`; fails the test with the output when it fails."""
    port = free_port()
    cmd = launch_command(num_ranks, args, port)
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout
        )
    finally:
        remove_shm_buffers(port)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its shared-memory buffers
    (/dev/shm/deepspeed_*_<port>_<rank>, 66 MB each) behind when the processes end; a test suite of
    multi-rank launches would fill /dev/shm (RAM)."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
        leftover.unlink(missing_ok=True)


def vllm_ident() -> str:
    """A launch's own VLLM_DIST_IDENT: grpo_ds.rollout.vllm keeps one set in the environment (else
    it draws one), and vLLM's CPU tensor-parallel groups name their /dev/shm
    segments <ident>-...-cpushm after it."""
    return f"grpo_ds-test-{uuid.uuid4().hex[:12]}"


# What differs between two runs of the same recipe in a rank's log (ranks/rank<r>.jsonl): the
# phases' wall-clock spans.
WALL_CLOCK_KEYS = ("phases",)


def rank_log_records(path: Path) -> list[dict]:
    """A rank's log (ranks/rank<r>.jsonl) without its wall-clock spans: what an identical run writes
    again."""
    return [
        {k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_KEYS}
        for line in path.read_text().splitlines()
    ]


def start_stoppable(command: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    """Start ``command`` in a session of its own (its pid is its process group's: a test can signal
    the group), its stderr piped, with SIGINT's default action: a test run from a background job
    of a non-interactive shell (CI) inherits SIGINT ignored, and the run would keep ignoring it."""
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(
    condition: Callable[[], bool],
    proc: subprocess.Popen,
    limit_s: float = 300,
    poll_s: float = 0.002,
) -> None:
    """Until ``condition()`` holds; fails, with the run's stderr, if ``proc`` ends first."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert proc.poll() is None, f"the run ended first:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll_s)
