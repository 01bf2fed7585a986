"""Host memory that glibc's allocator would keep through the training passes: large frees go back to
the system.

glibc's malloc serves a request smaller than its mmap threshold from its heap, and raises the
threshold to the size of every mapped block that is freed, up to 32 MiB. A step allocates and frees
thousands of tensors between 1 and 32 MiB (hidden states, attention scores, layer gradients,
generation's buffers); once the threshold has risen they all come from the heap, and freed heap
memory is handed back only from the heap's top. What one phase frees in the middle of the heap stays
in the process's resident set, and small blocks split the holes, so the heap grows under the next
phase.

``return_large_frees(True)``, called by the driver before the log-prob and update passes, fixes the
threshold at ``MMAP_THRESHOLD_BYTES`` (1 MiB): every larger block is a mapping of its own, returned
when the tensor is freed. ``return_large_frees(False)``, after the update, sets the threshold back
to glibc's 32 MiB ceiling for generation, whose many short-lived blocks of a few MiB (the KV cache
as it grows) would cost a page fault per page each as mappings. The update keeps its chunk buffers
for a whole call (grpo_ds.kernels.chunked), so it maps each one once. The heap that generation keeps
is not trimmed: handing it back every step and faulting it in again cost 20% of the update's time at
builtin:tiny's shape.

At the realistic shape of benchmarks/bench_vs_trl.py (a 43 M-parameter Qwen2 with a 151,936-entry
vocabulary, float32 on the CPU) this lowered a run's peak resident set from about 1,825 to
1,575 MiB, at the same step time within the machine's noise; benchmarks/RESULTS.md has the
benchmark's runs.

It applies where the C library is glibc. The environment variable ``MALLOC_MMAP_THRESHOLD_``
(glibc's own setting, read when the process starts) wins when it is set. Allocators loaded with
``LD_PRELOAD`` (jemalloc, tcmalloc) never see these calls.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

MMAP_THRESHOLD_BYTES = 2**20  # in the training passes
HEAP_BLOCK_MAX_BYTES = 32 * 2**20  # otherwise: glibc's ceiling for the threshold on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers, from glibc's malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"


@functools.cache
def _glibc():
    """The process's glibc, or None (another C library, or not Linux); looked up once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols the process already has, its C library among them
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt accepts the call and does nothing)
    except (OSError, AttributeError):
        return None
    return libc


def return_large_frees(on: bool) -> bool:
    """``on``: give every block of MMAP_THRESHOLD_BYTES or more a mapping of its own; off: blocks up
    to HEAP_BLOCK_MAX_BYTES come from the heap again. Returns whether the setting took (False: not
    glibc, or ``MALLOC_MMAP_THRESHOLD_`` set in the environment, which stands)."""
    libc = None if ENV in os.environ else _glibc()
    if libc is None:
        return False
    if on:
        return libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    # the trim threshold as glibc's own rule keeps it (twice the mmap threshold): the heap's top is
    # not handed back and faulted in again block after block
    return (
        libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_MAX_BYTES) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, 2 * HEAP_BLOCK_MAX_BYTES) == 1
    )
