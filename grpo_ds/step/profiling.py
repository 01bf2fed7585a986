"""Where a step's time goes: the driver's phases, timed and labelled, and torch.profiler traces of
chosen steps.

``Phase(name, times, spans)`` wraps one phase of the loop (rollout, reward, logprob, advantage,
update, sync, eval, checkpoint, wait): it adds the phase's wall time to ``times[name]`` (the step's
``time_<name>_s`` metric), appends ``[name, start, end]`` (``time.time()`` seconds) to ``spans``
(each rank's log: the timeline of grpo_ds.plot) and labels the block ``grpo/<name>`` with
``torch.profiler.record_function``, so a trace shows every operator, collective and kernel under the
phase that ran it. With no profiler running the label costs about 10 us.

``profiled_steps(steps, logging, run_dir, dist)`` yields the loop's step numbers. With
``logging.profile_steps`` ``[first, last]`` it records those steps with torch.profiler (CPU
activities, CUDA too on a GPU; operator input shapes) and writes one Chrome-trace JSON per rank,
``<run folder>/profile/rank<r>.pt.trace.json``, for ui.perfetto.dev or chrome://tracing. The step
before ``first`` (when the run has one) is a warm-up: the profiler runs but keeps nothing, so its
start-up cost stays out of the trace. Each step is labelled ``grpo/step <n>``. With
``logging.profile_comms`` DeepSpeed's communication logger counts the same steps' collectives (op,
message size, count) into ``profile/rank<r>.comms.txt``. The same steps (not the warm-up) get a
memory timeline (grpo_ds.step.memory_timeline): RSS, and CUDA allocated / reserved on a GPU, every
``logging.memory_sample_ms`` and at every phase boundary, into ``profile/rank<r>.memory.csv``.
``logging.profile_trace: false`` leaves the profiler out (its buffers would show in the timeline),
so only the timeline (and the collectives) are recorded. Off, the loop runs ``steps`` untouched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, record_function

from grpo_ds.config.recipe import LoggingConfig
from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import Dist
from grpo_ds.step import memory_timeline

LABEL_PREFIX = "grpo/"
PROFILE_DIR = "profile"


class Phase:
    """Time one phase of a step into ``times[name]`` (added, so a phase may run several times per
    step) and label it ``grpo/<name>`` in a profiler trace. ``times=None``: label only; ``.seconds``
    holds the wall time. While a memory timeline records, the phase's start and end are rows of
    it."""

    def __init__(
        self, name: str, times: dict[str, float] | None = None, spans: list | None = None
    ) -> None:
        self.name, self.times, self.spans, self.seconds = name, times, spans, 0.0
        self._label = record_function(LABEL_PREFIX + name)

    def __enter__(self) -> Phase:
        self._timeline = memory_timeline.current()
        if self._timeline is not None:
            self._timeline.enter(self.name)
        self._label.__enter__()
        self._start, self._wall = time.perf_counter(), time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
        self._label.__exit__(*exc)
        if self._timeline is not None:
            self._timeline.exit(self.name)
        if self.times is not None:
            self.times[self.name] = self.times.get(self.name, 0.0) + self.seconds
        if self.spans is not None:  # the rank log's timeline (grpo_ds.plot --timeline)
            self.spans.append(
                [self.name, round(self._wall, 4), round(self._wall + self.seconds, 4)]
            )


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROFILE_DIR / f"rank{rank}.pt.trace.json"


def comms_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROFILE_DIR / f"rank{rank}.comms.txt"


def memory_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROFILE_DIR / f"rank{rank}.memory.csv"


def profiled_steps(steps: range, cfg: LoggingConfig, run_dir: Path, dist: Dist) -> Iterator[int]:
    """The step numbers of ``steps``; those of ``cfg.profile_steps`` that the run reaches are traced
    and their memory sampled (a resumed run records the part of the range it runs)."""
    wanted = [
        s for s in steps if cfg.profile_steps and cfg.profile_steps[0] <= s <= cfg.profile_steps[1]
    ]
    if not wanted:
        yield from steps
        return
    first, last = wanted[0], wanted[-1]
    # the profiler's warm-up step
    start = first - 1 if cfg.profile_trace and first - 1 in steps else first
    profiler, timeline = None, None
    # closed at the range's end, or when the loop stops inside it
    with contextlib.ExitStack() as recorders:
        for step in steps:
            if step == start and cfg.profile_trace:
                profiler = _profiler(
                    first - start, last - first + 1, trace_path(run_dir, dist.rank), dist.device
                )
                profiler.start()
                recorders.callback(profiler.stop)  # writes the trace (on_trace_ready); runs last
            if step == first:
                timeline = recorders.enter_context(
                    memory_timeline.recording(
                        memory_path(run_dir, dist.rank),
                        cfg.memory_sample_ms / 1000,
                        dist.device,
                        step,
                    )
                )
                if cfg.profile_comms:
                    recorders.callback(_CommsLog().finish, comms_path(run_dir, dist.rank))
            elif timeline is not None:
                timeline.begin_step(step)
            with (
                record_function(f"{LABEL_PREFIX}step {step}")
                if profiler
                else contextlib.nullcontext()
            ):
                yield step
            if profiler is not None and step < last:
                profiler.step()
            if step == last:
                recorders.close()
                profiler = timeline = None
                if dist.is_main:
                    _say_where(
                        cfg, run_dir, f"step {first}" if first == last else f"steps {first}-{last}"
                    )


def _say_where(cfg: LoggingConfig, run_dir: Path, which: str) -> None:
    """Rank 0's line per file kind on stderr, with its own peak memory."""
    if cfg.profile_trace:
        launcher.say(
            f"profile: {which} traced to {trace_path(run_dir, 0).parent}/rank*.pt.trace.json (open "
            "in ui.perfetto.dev)"
        )
    rows = memory_timeline.read_rows(memory_path(run_dir, 0))
    launcher.say(
        f"profile: memory of {which} sampled every {cfg.memory_sample_ms} ms to "
        f"{memory_path(run_dir, 0).parent}/rank*.memory.csv; rank 0's "
        f"{memory_timeline.summary(rows)} (draw it: python -m grpo_ds.plot {run_dir} --memory)"
    )


def _profiler(warmup: int, active: int, path: Path, device: torch.device) -> torch.profiler.profile:
    """A profiler whose schedule warms up for ``warmup`` steps, then records ``active`` steps and
    writes ``path``."""

    def schedule(index: int) -> ProfilerAction:
        if index < warmup:
            return ProfilerAction.WARMUP
        return (
            ProfilerAction.RECORD_AND_SAVE
            if index == warmup + active - 1
            else ProfilerAction.RECORD
        )

    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        record_shapes=True,
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    )


class _CommsLog:
    """DeepSpeed's communication logger (``deepspeed.comm``: ZeRO-3's gathers and reductions)
    switched on for the profiled steps; ``finish`` writes this rank's collectives as op, message
    size, count and bytes. It takes no collective of its own, so no rank waits on another. Its
    latencies are left out: DeepSpeed 0.19 records each one as the running total of that op's
    earlier calls (``timers(name).elapsed(reset=False)`` in ``timed_op``), so the trace's ``gloo:*``
    / ``nccl:*`` spans are the times to read. The logger synchronises the device after every
    collective it counts, so with it on a GPU trace shows no communication overlapping compute."""

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm

        self._comm, logger = ds_comm, ds_comm.comms_logger
        # a DeepSpeed config may have switched it on itself
        self._before = (logger.enabled, logger.prof_all)
        logger.reset_data()
        ds_comm.configure(enabled=True, prof_all=True)

    def finish(self, path: Path) -> None:
        logger = self._comm.comms_logger
        lines = [f"{'op':<28}{'message bytes':>14}{'count':>8}{'total MiB':>12}"]
        for op, by_size in logger.get_raw_data().items():
            for size, (count, *_) in sorted(by_size.items()):
                lines.append(f"{op:<28}{size:>14}{count:>8}{size * count / 2**20:>12.3f}")
        path.write_text("\n".join(lines) + "\n")
        logger.reset_data()
        self._comm.configure(enabled=self._before[0], prof_all=self._before[1])
