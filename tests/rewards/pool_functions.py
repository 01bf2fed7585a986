"""Reward functions that the worker-pool tests load by name (``tests.rewards.pool_functions:NAME``),
as a recipe would.

Each scores a sample by its own text, so its score cannot depend on how the batch was cut."""

import asyncio
import ctypes
import os


def length(*, completions, **kwargs):
    return [len(c) / 10 for c in completions]


def matches(*, completions, answer, **kwargs):
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer, strict=True)]


async def slow_async(*, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float("7" in c) for c in completions]


def exits(*, completions, **kwargs):
    """Ends its process (as a C extension calling exit would) when a completion says so."""
    if any("exit" in c for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def segfaults(*, completions, **kwargs):
    if any("crash" in c for c in completions):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return [1.0] * len(completions)


def hangs(*, completions, **kwargs):
    """Spins, holding the GIL, when a completion says so: no thread could ever stop it."""
    while any("hang" in c for c in completions):
        pass
    return [1.0] * len(completions)


def allocates(*, completions, **kwargs):
    if any("big" in c for c in completions):
        blob = bytearray(3 * 2**30)  # 3 GiB
        return [float(len(blob) > 0)] * len(completions)
    return [1.0] * len(completions)
