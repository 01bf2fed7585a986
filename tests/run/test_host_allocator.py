"""grpo_ds.run.host_allocator: in the training passes, freed tensors of 1 MiB and more leave the
resident set at once (glibc)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo_ds.run import host_allocator

# In a fresh interpreter: 200 tensors of 2 MiB, then a small one that keeps the heap from shrinking
# at its top, then the large ones freed. Prints whether the setting took and how much of their
# 400 MiB left the resident set.
_PROBE = """
import sys, torch
from grpo_ds.run.host_allocator import return_large_frees
from grpo_ds.step.memory_timeline import host_memory
applied = return_large_frees(sys.argv[1] == "on")
large = [torch.ones(2**19) for _ in range(200)]  # 2 MiB each, written, so resident
pin = torch.ones(75_000)  # 300 kB above them
before = host_memory()[0]
del large
after = host_memory()[0]
print(applied, (before - after) / 2**20)
"""


def _freed_mib(mode: str, env: dict | None = None) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_frees_leave_the_resident_set():
    applied, freed = _freed_mib("on")
    assert applied
    assert freed > 350  # nearly all of the 400 MiB
    # outside the training passes, glibc keeps them on its heap: the same frees give back (almost)
    # nothing
    applied, kept = _freed_mib("off")
    assert applied and kept < 50


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_environment_variable_wins():
    # the user's own threshold, above the probe's 2 MiB tensors
    env = {host_allocator.ENV: str(64 * 2**20)}
    applied, freed = _freed_mib("on", env)
    assert not applied and freed < 50
