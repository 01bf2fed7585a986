"""Compiled decoding for the hf engine (``rollout.hf_compile``): a static KV cache and a
``torch.compile``'d decode step (CUDA graphs on a GPU: mode "reduce-overhead"), watched so that a
compile that fails or hangs falls back to eager generation instead of stopping the run.

Why: at a 0.5 B model's shape on a GPU, transformers' eager decode loop is bound by kernel launches
(~16 ms per token step on an H200, 4.2 s of a 4.95 s training step); one CUDA graph per decode step
launches them all at once.

How: transformers' own path. The engine passes generate a ``StaticCache`` and a GenerationConfig
with a ``CompileConfig`` (``CompiledDecode.generate_kwargs``); generate then runs the prefill
eagerly and every decode step through ``model.get_compiled_call`` (transformers'
``GenerationMixin._valid_auto_compile_criteria`` decides: it compiles on CUDA, and on a CPU only
when the CompileConfig's private ``_compile_all_devices`` is set, which ``generate_kwargs`` does:
the engine has already decided). The logits processors, the recipe's warpers and TokenSampler (which
picks each token and records its log-prob), stay eager, so token picking is the same code on the
same random numbers; only the logits differ, by float rounding (inductor's fused kernels, attention
over a fixed-length cache with masked slots).

Recompiles and re-recordings: dynamo specialises on shapes, here the batch's rows and the static
cache's length; a CUDA graph on the cache's addresses. So the cache is made once per batch size and
reused (reset in place) by every later call, rather than made afresh by generate each call (torch
would re-record the graph for the new addresses, and after cudagraph_unexpected_rerecord_limit, 128,
re-recordings run that step without CUDA graphs). Its length is the longest prompt width +
max_new_tokens seen so far, rounded up to a multiple of CACHE_LEN_STEP; a longer one replaces the
caches. A run compiles once per distinct batch size (the last generate call of a step can be
smaller) and a few times at most for the length. The price: the caches stay allocated between
generate calls, rows x length x layers x 2 x KV heads x head dim elements each (at the 0.5 B shape,
128 x 512 x 24 x 2 x 2 x 64 in bf16: 0.8 GB).

Watchdog: every compiled generate call runs on one worker thread (compiling, CUDA-graph recording
and replay stay on one thread: torch keeps its CUDA-graph trees per thread), and the caller waits
for it while watching its progress, the number of tokens picked so far. If no new token comes for
``timeout_s`` (a compile that hangs or runs past the bound; the first decode step waits for the
compile), or the call raises, the caller says so in one line, generates that batch eagerly (fresh
sampler, same random streams: the same samples as a run that never compiled) and stays eager for the
rest of the run. Python cannot kill a thread: a hung compile stays blocked in its worker, holding
its static cache and whatever the compiler holds, until the process exits; the worker is a daemon,
so it never keeps the process alive at exit (a hang in C code that held Python's GIL would stop the
caller too; waiting on a lock, a future or a compile worker releases it). If the compile ever wakes
up, the worker finishes that one generate call into its own cache and sampler (still reading the
model's weights, while the caller generates or trains on), its result is dropped, and the worker
ends: it is sent no more calls.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.generation import CompileConfig
from transformers.generation import utils as generation_utils

from grpo_ds.distributed import launcher
from grpo_ds.errors import first_line

T = TypeVar("T")
CHOICES = ("auto", "on", "off")  # rollout.hf_compile
# static cache length: prompt width + max_new_tokens, rounded up to a multiple of this
CACHE_LEN_STEP = 256


def cache_length(positions: int) -> int:
    """The static cache's length for ``positions`` (prompt width + max_new_tokens): rounded up to
    CACHE_LEN_STEP."""
    return CACHE_LEN_STEP * math.ceil(positions / CACHE_LEN_STEP)


def compile_wanted(setting: str, device: torch.device | str) -> bool:
    """rollout.hf_compile on ``device``: "on", "off", or "auto" (the default): on CUDA only, where a
    decode step is launch-bound (benchmarks/RESULTS.md, bench_vs_trl on an H200, 2026-11-28: the
    compiled rollout phase took 2.0 s a step, TRL's eager generate 6.5 s at the same shape; on a
    2-core CPU the compiled calls took about twice the CPU time of eager ones, bench_rollout
    2026-11-27)."""
    if setting not in CHOICES:
        raise ValueError(f"rollout.hf_compile must be one of {CHOICES}, not {setting!r}")
    return torch.device(device).type == "cuda" if setting == "auto" else setting == "on"


# generate's keyword for a Cache object: "cache" from transformers 5.2x (which still takes
# "past_key_values", with a deprecation warning), "past_key_values" before (5.17.0).
CACHE_KWARG = (
    "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
)


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class CompiledDecode:
    """Runs the hf engine's compiled generate calls on one daemon worker thread under a progress
    watchdog; see the module docstring. ``failed`` says why it fell back (None while it has not)."""

    def __init__(
        self,
        device: torch.device | str,
        timeout_s: float,
        say: Callable[[str], None] | None = None,
        poll_s: float = 0.25,
    ) -> None:
        self.device = torch.device(device)
        # the caller's current device, not the worker's
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.say = say or launcher.say_on_each_rank
        self.poll_s = poll_s
        self.failed: str | None = None
        # rows -> the static cache of that batch size, all one length
        self.caches: dict[int, StaticCache] = {}
        self.cache_len = 0
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def run(self, fn: Callable[[], T], progress: Callable[[], int]) -> T | None:
        """``fn()`` (one compiled generate call) on the worker; ``progress()``: tokens it has picked
        so far. None when compiled decoding has failed, now or before: the caller then generates
        eagerly."""
        if self.failed is not None:
            return None
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._serve, name="grpo_ds-hf-compile", daemon=True
            )
            self._worker.start()
        call = _Call(fn)
        self._calls.put(call)
        seen, since = progress(), time.monotonic()
        while not call.done.wait(self.poll_s):
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                self._give_up(
                    f"made no progress for {self.timeout_s:g} s after {seen} tokens (a compile "
                    "that hangs or runs past rollout.hf_compile_timeout_s); "
                    "its thread is left blocked"
                )
                return None
        if call.error is not None:
            self._give_up(f"failed: {type(call.error).__name__}: {first_line(call.error)}")
            return None
        return call.result

    def generate_kwargs(
        self, model: PreTrainedModel, rows: int, width: int, max_new_tokens: int
    ) -> dict[str, Any]:
        """generate's extra keywords for one compiled call of ``rows`` rows on prompts ``width``
        tokens wide (left-padded): the CompileConfig, and a static cache reset for the call (called
        on the worker thread)."""
        compile_config = CompileConfig(
            fullgraph=False,
            dynamic=False,
            mode="reduce-overhead" if self.device.type == "cuda" else "default",
        )
        # transformers' private switch, checked on transformers 5.17.0 and 5.24.0: without it
        # generate compiles only on CUDA, XPU, neuron and TPU devices and runs a CPU model eagerly
        # without a word.
        compile_config._compile_all_devices = True
        length = cache_length(width + max_new_tokens)
        if length > self.cache_len:
            self.caches.clear()
            self.cache_len = length
        cache = self.caches.get(rows)
        if cache is None:
            cache = self.caches[rows] = StaticCache(
                config=model.config, max_cache_len=self.cache_len
            )
        else:
            cache.reset()
        return {"compile_config": compile_config, CACHE_KWARG: cache}

    def _give_up(self, reason: str) -> None:
        self.failed = reason
        self.caches = {}  # the engine's; a hung call holds on to its own
        self._calls.put(None)  # the worker ends after the call it is in, if it ever returns
        self.say(
            "warning: rollout.hf_compile: compiled decoding "
            f"{reason}; generating eagerly from now on"
        )

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                if self.device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(self.device)
                call.result = call.fn()
            except BaseException as error:  # noqa: BLE001 - reported by the caller, which falls back to eager
                call.error = error
            finally:
                call.done.set()
