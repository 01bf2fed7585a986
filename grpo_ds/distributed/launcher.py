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
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager


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


def say(message: str) -> None:
    """One line for the user on stderr, printed by rank 0 only (every rank runs the same code; one
    copy is enough)."""
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)


def say_on_each_rank(message: str) -> None:
    """One line on stderr from whichever rank calls it, prefixed with the rank beyond rank 0: for
    what happens to one rank on its own (a compile that fails on one rank only, say)."""
    print(message if rank() == 0 else f"rank {rank()}: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A TCP port free on this host now (for a process group of one, or a test's launcher)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
