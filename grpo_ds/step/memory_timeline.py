"""Where a step's memory goes: this process's memory sampled through the profiled steps, phase by
phase.

While ``logging.profile_steps`` runs (grpo_ds.step.profiling), a ``MemoryTimeline`` records one row
every ``logging.memory_sample_ms`` milliseconds from a daemon thread, and one more at each step's
start and at each phase's start and end (``Phase`` reports them through ``current()``), so a phase
shorter than the interval still has two rows. The columns of
``<run folder>/profile/rank<r>.memory.csv``:

- ``seconds``: since the timeline started; ``step``: the step running;
- ``phase``: the innermost phase running, "" between phases; ``event``: "sample" (the thread's),
  "step" (a step starts), "start" or "end" (a phase's boundary; an "end" row still names the phase
  that ends);
- ``rss_bytes``, ``rss_anon_bytes``: VmRSS and RssAnon of /proc/self/status: the resident pages, and
  those of them no file backs (the heap, allocator caches, tensors). Without /proc: psutil's rss, or
  else getrusage's peak so far, and RssAnon left empty;
- ``cuda_allocated_bytes``, ``cuda_reserved_bytes``: torch.cuda.memory_allocated / memory_reserved
  of this rank's device (the tensors, and what the caching allocator holds for them); empty on a
  CPU.

The rows are kept as doubles in one array (64 bytes a row, so at 10 ms the timeline itself grows
6.4 KB a second) and written when the range ends. ``phase_peaks`` reads a file back into one
``PhasePeak`` per phase, and ``format_table`` prints those as a markdown table in MiB.
"""

from __future__ import annotations

import contextlib
import csv
import math
import re
import sys
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_ds.errors import UserError

COLUMNS = (
    "seconds",
    "step",
    "phase",
    "event",
    "rss_bytes",
    "rss_anon_bytes",
    "cuda_allocated_bytes",
    "cuda_reserved_bytes",
)
EVENTS = ("sample", "step", "start", "end")  # an event's index is its code in the in-memory rows
SAMPLE, STEP, START, END = range(len(EVENTS))
MIB = 2**20

_current: MemoryTimeline | None = None


def current() -> MemoryTimeline | None:
    """The timeline recording now, or None. ``Phase`` asks it at each boundary: phases open deep in
    the step (the rollout's inside grpo_ds.step.collect) where no handle to the timeline reaches, so
    one slot holds it, set only between ``start`` and ``stop``. With no timeline, a phase pays this
    call."""
    return _current


@dataclass(frozen=True)
class Row:
    """One row of a memory timeline; the byte counts that were not measured are None."""

    seconds: float
    step: int
    phase: str
    event: str
    rss: int
    rss_anon: int | None
    cuda_allocated: int | None
    cuda_reserved: int | None


class MemoryTimeline:
    """Samples this process's memory every ``interval_s`` seconds on a daemon thread, and on each
    ``begin_step``, ``enter`` and ``exit`` on the caller's thread; ``rows()`` gives what it
    recorded, ``write`` the CSV file."""

    def __init__(self, interval_s: float, device: torch.device) -> None:
        self.interval_s = interval_s
        self._cuda = device if device.type == "cuda" else None
        # len(COLUMNS) doubles a row; phase as an index of _names, event as one of EVENTS
        self._data = array("d")
        self._names, self._ids = [""], {"": 0}
        self._open: list[int] = []  # the phases running, innermost last
        self._step = 0
        self._lock = threading.Lock()  # one writer at a time, so the rows stay in time order
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._sample_until_stopped, name="grpo-memory-timeline", daemon=True
        )
        self._t0 = 0.0

    def start(self, step: int) -> None:
        """Recording from ``step``'s start: its row is the first, written before the sampling thread
        runs (a sample taken before it would be counted in no step)."""
        global _current
        self._t0 = time.perf_counter()
        _current = self
        self.begin_step(step)
        self._thread.start()

    def stop(self) -> None:
        """The last row, then no more (idempotent)."""
        global _current
        if _current is self:
            _current = None
        if not self._stopping.is_set():
            self._stopping.set()
            self._thread.join()
            self._record(SAMPLE)

    def begin_step(self, step: int) -> None:
        with self._lock:
            self._step = step
            self._append(STEP)

    def enter(self, phase: str) -> None:
        with self._lock:
            if phase not in self._ids:
                self._ids[phase] = len(self._names)
                self._names.append(phase)
            self._open.append(self._ids[phase])
            self._append(START)

    def exit(self, phase: str) -> None:
        """``phase``, the innermost one open, ends."""
        with self._lock:
            self._append(END)  # still inside the phase: its last row
            if self._open:
                self._open.pop()

    def rows(self) -> list[Row]:
        with self._lock:
            data = self._data.tolist()
        width = len(COLUMNS)
        return [_row(data[i : i + width], self._names) for i in range(0, len(data), width)]

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            out = csv.writer(f)
            out.writerow(COLUMNS)
            for r in self.rows():
                out.writerow(
                    (
                        f"{r.seconds:.6f}",
                        r.step,
                        r.phase,
                        r.event,
                        r.rss,
                        *(
                            "" if v is None else v
                            for v in (r.rss_anon, r.cuda_allocated, r.cuda_reserved)
                        ),
                    )
                )

    def _sample_until_stopped(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self._record(SAMPLE)

    def _record(self, event: int) -> None:
        with self._lock:
            self._append(event)

    def _append(self, event: int) -> None:
        """One row now; the caller holds the lock."""
        seconds = time.perf_counter() - self._t0
        rss, anon = host_memory()
        if self._cuda is not None:
            allocated, reserved = (
                torch.cuda.memory_allocated(self._cuda),
                torch.cuda.memory_reserved(self._cuda),
            )
        else:
            allocated = reserved = math.nan
        phase = self._open[-1] if self._open else 0
        self._data.extend(
            (
                seconds,
                self._step,
                phase,
                event,
                rss,
                math.nan if anon is None else anon,
                allocated,
                reserved,
            )
        )


@contextlib.contextmanager
def recording(
    path: Path, interval_s: float, device: torch.device, step: int
) -> Iterator[MemoryTimeline]:
    """A timeline started at ``step``'s start; on leaving (the range's end, or the loop stopping
    inside it) it stops and writes ``path``."""
    timeline = MemoryTimeline(interval_s, device)
    timeline.start(step)
    try:
        yield timeline
    finally:
        timeline.stop()
        timeline.write(path)


# ---------------------------------------------------------------------------- this process's memory

_STATUS_FIELDS = re.compile(rb"^(VmRSS|RssAnon):\s+(\d+) kB", re.MULTILINE)


def _proc_status() -> tuple[int, int | None]:
    with open("/proc/self/status", "rb") as f:  # about 15 us
        fields = dict(_STATUS_FIELDS.findall(f.read()))
    anon = fields.get(b"RssAnon")  # Linux 4.5 and later
    return int(fields[b"VmRSS"]) * 1024, None if anon is None else int(anon) * 1024


def _psutil() -> tuple[int, int | None]:
    import psutil

    return psutil.Process().memory_info().rss, None


def _rusage_peak() -> tuple[int, int | None]:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024, None  # bytes on macOS, KiB elsewhere


def _pick_reader():
    if Path("/proc/self/status").is_file():
        return _proc_status
    try:
        import psutil  # noqa: F401
    except ImportError:
        return _rusage_peak
    return _psutil


_READER = _pick_reader()


def host_memory() -> tuple[int, int | None]:
    """(RSS, RssAnon) of this process in bytes; RssAnon is None where there is no /proc."""
    return _READER()


# ------------------------------------------------------------------------------- reading a timeline


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a ``rank<r>.memory.csv`` file, in time order."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            str(path),
            "not found",
            "logging.profile_steps=[first, last] writes the memory timeline of "
            "those steps into <run folder>/profile",
        )
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = tuple(next(reader, ()))
        if header != COLUMNS:
            raise UserError(
                str(path),
                f"is not a memory timeline (its header is {','.join(header) or 'empty'})",
                f"expected {','.join(COLUMNS)}",
            )
        return [
            Row(float(s), int(step), phase, event, int(rss), *(int(v) if v else None for v in rest))
            for s, step, phase, event, rss, *rest in reader
        ]


@dataclass(frozen=True)
class Span:
    """One run of a phase: rows ``first`` (its "start") to ``last`` (its "end", or the timeline's
    last row where the loop stopped inside it), in step ``step``. An outer phase's span holds the
    spans nested in it."""

    phase: str
    step: int
    first: int
    last: int


def spans(rows: Sequence[Row]) -> list[Span]:
    """The phase runs of a timeline, in the order they start."""
    found, running = [], []  # running: (phase, index of its start row), innermost last
    for i, row in enumerate(rows):
        if row.event == "start":
            running.append((row.phase, i))
        elif row.event == "end" and row.phase in (phase for phase, _ in running):
            while True:  # a run left open inside this one (no Phase does that) ends with it
                phase, first = running.pop()
                found.append(Span(phase, rows[first].step, first, i))
                if phase == row.phase:
                    break
    found += [Span(phase, rows[first].step, first, len(rows) - 1) for phase, first in running]
    return sorted(found, key=lambda span: span.first)


@dataclass(frozen=True)
class PhasePeak:
    """A phase's highest memory in a timeline. A phase runs once a step or more; ``start_rss`` is
    RSS when the run that reached ``peak_rss`` began (in step ``peak_step``), so ``rss_rise`` is
    what that run added on top. CUDA likewise, for the run with the highest allocated peak; None on
    a CPU. A run includes the phases nested in it."""

    phase: str
    runs: int
    peak_step: int
    start_rss: int
    peak_rss: int
    start_cuda_allocated: int | None = None
    peak_cuda_allocated: int | None = None
    peak_cuda_reserved: int | None = None

    @property
    def rss_rise(self) -> int:
        return self.peak_rss - self.start_rss


def phase_peaks(path: str | Path) -> list[PhasePeak]:
    """One ``PhasePeak`` per phase of a timeline file, in the order the phases first start."""
    return peaks_of(read_rows(path))


def peaks_of(rows: Sequence[Row]) -> list[PhasePeak]:
    """``phase_peaks`` of rows already read."""
    best: dict[str, PhasePeak] = {}  # in the order of the phases' first runs, as spans() come
    for span in spans(rows):
        run = rows[span.first : span.last + 1]
        allocated = [r.cuda_allocated for r in run if r.cuda_allocated is not None]
        reserved = [r.cuda_reserved for r in run if r.cuda_reserved is not None]
        _fold(
            best,
            PhasePeak(
                span.phase,
                1,
                span.step,
                run[0].rss,
                max(r.rss for r in run),
                run[0].cuda_allocated,
                max(allocated, default=None),
                max(reserved, default=None),
            ),
        )
    return list(best.values())


def _fold(best: dict[str, PhasePeak], run: PhasePeak) -> None:
    """Keep, per phase, the run with the highest RSS (and the CUDA numbers of the one with the
    highest allocated)."""
    seen = best.get(run.phase)
    if seen is None:
        best[run.phase] = run
        return
    rss = run if run.peak_rss > seen.peak_rss else seen
    cuda = run if (run.peak_cuda_allocated or 0) > (seen.peak_cuda_allocated or 0) else seen
    reserved = [v for v in (seen.peak_cuda_reserved, run.peak_cuda_reserved) if v is not None]
    best[run.phase] = PhasePeak(
        run.phase,
        seen.runs + 1,
        rss.peak_step,
        rss.start_rss,
        rss.peak_rss,
        cuda.start_cuda_allocated,
        cuda.peak_cuda_allocated,
        max(reserved, default=None),
    )


def format_table(peaks: Sequence[PhasePeak]) -> str:
    """A markdown table of ``peaks``, in MiB; the CUDA columns only where a peak has them."""
    header = ["phase", "runs", "step of peak", "RSS at start (MiB)", "peak RSS (MiB)", "rise (MiB)"]
    cuda = any(p.peak_cuda_allocated is not None for p in peaks)
    if cuda:
        header += [
            "CUDA allocated at start (MiB)",
            "peak CUDA allocated (MiB)",
            "peak CUDA reserved (MiB)",
        ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in peaks:
        cells = [
            p.phase,
            str(p.runs),
            str(p.peak_step),
            *(_mib(v) for v in (p.start_rss, p.peak_rss, p.rss_rise)),
        ]
        if cuda:
            cells += [
                _mib(v)
                for v in (p.start_cuda_allocated, p.peak_cuda_allocated, p.peak_cuda_reserved)
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    """Where the peaks are: "peak RSS 812.3 MiB in update (step 3)", and CUDA allocated's on a
    GPU."""
    parts = []
    for what, key in (("RSS", "rss"), ("CUDA allocated", "cuda_allocated")):
        measured = [r for r in rows if getattr(r, key) is not None]
        if measured:
            top = max(measured, key=lambda r: getattr(r, key))
            where = f"in {top.phase}" if top.phase else "between phases"
            parts.append(f"peak {what} {_mib(getattr(top, key))} MiB {where} (step {top.step})")
    return ", ".join(parts)


def _row(values: list[float], names: list[str]) -> Row:
    seconds, step, phase, event, rss, *rest = values
    return Row(
        seconds,
        int(step),
        names[int(phase)],
        EVENTS[int(event)],
        int(rss),
        *(None if math.isnan(v) else int(v) for v in rest),
    )


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.1f}"
