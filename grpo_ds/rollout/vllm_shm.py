"""Shared-memory segments that vLLM's CPU tensor parallelism leaves in /dev/shm, and their removal.

vLLM's CPU communicator (vllm/distributed/device_communicators/cpu_communicator.py) gives each
tensor-parallel group shared-memory segments named ``<ident>-<group>-[<ranks>]-cpushm_<rank>``. Its
CPU worker sets ``ident`` from the distributed init method (vllm/v1/worker/cpu_worker.py, vLLM
0.32's CPU build), which under the external launcher is the same for every run, so every run on a
machine uses the same names. A rank that leaves without vLLM's teardown (grpo_ds's launched ranks
end by ``os._exit``; a killed run) leaves its segments behind, and the next run's engine then fails
with "create shm in SHMManager failed. errno: 17" (EEXIST). A segment that no live process maps or
holds open is such a leftover: ``stale_segments`` finds them and the engine removes them before it
is built.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")
PATTERN = "*cpushm_*"  # vLLM's CPU tensor-parallel segments


def held_paths(proc: Path = Path("/proc")) -> set[str]:
    """Paths that a live process maps (/proc/<pid>/maps) or holds open (/proc/<pid>/fd); processes
    this one may not read are skipped."""
    held: set[str] = set()
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            held.update(
                line.split(maxsplit=5)[5].strip()
                for line in (pid / "maps").read_text().splitlines()
                if line.count(" ") >= 5 and "/" in line
            )
            held.update(os.readlink(fd) for fd in (pid / "fd").iterdir())
        except OSError:  # the process ended, or is another user's
            continue
    return held


def stale_segments(directory: Path = SHM, pattern: str = PATTERN) -> list[Path]:
    """The segments under ``directory`` matching ``pattern`` that no live process maps or holds
    open."""
    found = sorted(directory.glob(pattern))
    if not found:
        return []
    held = held_paths()
    return [p for p in found if str(p) not in held]


def remove_stale_segments(directory: Path = SHM, pattern: str = PATTERN) -> list[Path]:
    """Remove ``stale_segments``; returns what it removed."""
    removed = []
    for path in stale_segments(directory, pattern):
        try:
            path.unlink()
        except FileNotFoundError:  # another rank or run removed it first
            continue
        removed.append(path)
    return removed
