"""The launcher's variables and the console, read in one place.

The ``deepspeed`` launcher (and torchrun) start each rank with RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_SIZE set; a plain ``python -m grpo_ds.train`` or a notebook has none of them and is world
size 1. Everything that asks "was I launched?", "am I rank 0?" or "how many ranks?" before (or
without) a process group asks here, and a message for the user is printed once, by rank 0, through
``say``. DeepSpeed's accelerator variable (DS_ACCELERATOR) is read and defaulted here too. After the
process group exists, grpo_ds.distributed.ranks.Dist answers the same questions for the driver (its
rank is the launcher's RANK). Nothing here imports torch.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# set by grpo_ds.launch for the ranks under it: the folder where each rank records its exit code,
# and that command's pid (the ranks stop if it is killed)
EXITS_VAR = "GRPO_DS_LAUNCH_EXITS"
LAUNCH_PID_VAR = "GRPO_DS_LAUNCH_PID"
# the module DeepSpeed's runner starts on each node, whose children are the node's ranks
NODE_LAUNCHER = "deepspeed.launcher.launch"


def launched() -> bool:
    """Whether a launcher started this process as one rank of a job (RANK is set)."""
    return "RANK" in os.environ


def rank() -> int:
    """This process's global rank (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The job's number of ranks (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This rank's index on its node: the GPU it drives (0 when not launched)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_ranks() -> int:
    """Ranks on this node (the ``deepspeed`` launcher's LOCAL_SIZE; 1 when not set)."""
    return int(os.environ.get("LOCAL_SIZE", "1"))


def cpu_forced() -> bool:
    """Whether DS_ACCELERATOR=cpu keeps DeepSpeed (and so grpo_ds) off any GPU."""
    return os.environ.get("DS_ACCELERATOR", "") == "cpu"


def use_cpu_accelerator() -> None:
    """Tell DeepSpeed to use its CPU accelerator (DS_ACCELERATOR=cpu) unless the user chose one.
    DeepSpeed picks its accelerator once, when first imported, and without a GPU says so on stdout
    unless told: call this before."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


@contextmanager
def as_launched(rank: int, world_size: int, local_rank: int) -> Iterator[None]:
    """For the duration, this process's environment holds the launcher's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, and MASTER_ADDR / MASTER_PORT where unset), as a library that expects to
    have been launched reads them (vLLM's external launcher); afterwards each is as it was, so that
    a plain process does not look ``launched()``."""
    wanted = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank)}
    if "MASTER_ADDR" not in os.environ:
        wanted["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in os.environ:
        wanted["MASTER_PORT"] = str(free_port())
    before = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def record_exit(code: int) -> None:
    """A rank under ``python -m grpo_ds.launch`` records the code it is about to exit with, for that
    command to return (grpo_ds/launch.py); elsewhere nothing happens. Called as soon as the code is
    known, so that a rank killed on its way out has said it."""
    folder = os.environ.get(EXITS_VAR)
    if not folder or not launched():
        return
    try:
        (Path(folder) / f"rank{rank()}").write_text(str(code))
    except OSError:  # the command is gone: no one to tell
        pass


def recorded_exits(folder: Path) -> dict[int, int]:
    """The codes the ranks recorded in ``folder`` (``record_exit``), by rank."""
    codes = {}
    for path in folder.glob("rank*"):
        try:
            codes[int(path.name.removeprefix("rank"))] = int(path.read_text())
        except ValueError:  # a name that is not a rank's, or a write cut short
            continue
    return codes


def say(message: str) -> None:
    """One line for the user on stderr, printed by rank 0 only (every rank runs the same code; one
    copy is enough)."""
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)


def say_on_each_rank(message: str) -> None:
    """One line on stderr from whichever rank calls it, prefixed with the rank beyond rank 0: for
    what happens to one rank on its own (a compile that fails on one rank only, say)."""
    print(message if rank() == 0 else f"rank {rank()}: {message}", file=sys.stderr, flush=True)


# a launch's master port is drawn below the kernel's ephemeral range, where no socket bound to port
# 0 and no outgoing connection (gloo opens many) can take it between the draw and the launch's bind
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DRAWN_PORTS = 10_000


def free_port() -> int:
    """A TCP port P free on this host now, with P + 1 free too (a split launch serves its bridge's
    store at MASTER_PORT + 1): for a process group of one, or a test's launcher. Drawn at random
    from the ports just below the ephemeral range; where that range is unknown, or no pair there
    is free, one the kernel picks."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    low = max(1024, ephemeral_low - _DRAWN_PORTS)
    draw = random.SystemRandom()
    for _ in range(100 if ephemeral_low > low + 1 else 0):
        port = draw.randrange(low, ephemeral_low - 1)
        if _bindable(port) and _bindable(port + 1):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
