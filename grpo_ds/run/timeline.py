"""Each rank's phases over wall time, read from the run folder's per-rank logs
(``grpo_ds.plot --timeline``).

Every rank appends one JSON object a step to ``RUN_DIR/ranks/rank<r>.jsonl``; a step's record
carries the rank's ``role`` ("colocated", "trainer" or "rollout") and ``phases``, the wall-clock
spans of the phases it ran for that step: ``[[name, start, end], ...]`` in ``time.time()`` seconds.
A rollout rank's record for step k holds what it ran to produce step k's samples, so under staleness
its spans for step k come before the trainer's; under continuous generation it also holds the
running batch since its previous record (``running_rows``: [time, rows in flight] pairs).

The file is read the way a crash or a resume leaves it: unreadable lines (a torn last line), lines
without ``phases`` and malformed spans are skipped, and when a step appears more than once the last
record wins.

Busy and idle seconds of a rank, over its spans of the steps drawn: busy is the time covered by any
phase other than ``wait`` (overlapping spans counted once); idle is the rest of the window from its
first span's start to its last span's end, that is the ``wait`` spans plus the gaps no span covers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from grpo_ds.errors import UserError

IDLE = "wait"  # the phase name of a rank waiting for the other side
# steps drawn when --steps is not given: all of them up to this many, else the last this many
DEFAULT_STEPS = 20
RANK_LOG = re.compile(r"rank(\d+)\.jsonl")
FIX = "a run made by this version of grpo_ds.train writes them (RUN_DIR/ranks/rank<r>.jsonl)"


@dataclass(frozen=True)
class Span:
    phase: str
    step: int
    start: float  # time.time() seconds
    end: float


@dataclass(frozen=True)
class Lane:
    """One rank's spans over the steps drawn, in start order."""

    rank: int
    role: str
    spans: tuple[Span, ...]
    # continuous generation's running batch over time: (time.time(), rows), in time order
    running: tuple[tuple[float, int], ...] = ()

    @property
    def window_s(self) -> float:
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    @property
    def busy_s(self) -> float:
        return _covered([(s.start, s.end) for s in self.spans if s.phase != IDLE])

    @property
    def idle_s(self) -> float:
        return self.window_s - self.busy_s

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.window_s if self.window_s > 0 else 0.0


@dataclass(frozen=True)
class Timeline:
    lanes: tuple[Lane, ...]  # by rank; a rank with no span in the steps drawn has no lane
    steps: tuple[int, ...]  # the steps drawn
    available: tuple[int, ...]  # every step that holds phases in the logs

    @property
    def origin(self) -> float:
        """The earliest start among the spans drawn: the pictures' zero."""
        return min(s.start for lane in self.lanes for s in lane.spans)


def parse_steps(text: str) -> tuple[int, int]:
    """``FIRST:LAST`` (inclusive) -> (first, last)."""
    first, colon, last = text.partition(":")
    try:
        bounds = (int(first), int(last))
    except ValueError:
        bounds = None
    if not colon or bounds is None or bounds[0] > bounds[1]:
        raise UserError(
            "--steps",
            f"{text!r} is not FIRST:LAST",
            "give two step numbers, the first not above the last, e.g. --steps 5:12",
        )
    return bounds


def read_timeline(run_dir: str | Path, steps: tuple[int, int] | None = None) -> Timeline:
    """The lanes of RUN_DIR/ranks/rank*.jsonl for the steps ``first..last`` (default: all steps if
    at most DEFAULT_STEPS hold phases, else the last DEFAULT_STEPS)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(
            str(run_dir),
            "is not a folder" if run_dir.exists() else "not found",
            "give a run folder (run.output_dir/run.name)",
        )
    folder = run_dir / "ranks"
    logs = {
        int(m.group(1)): p for p in folder.glob("rank*.jsonl") if (m := RANK_LOG.fullmatch(p.name))
    }
    if not logs:
        raise UserError(
            str(folder), "not found" if not folder.is_dir() else "holds no rank<r>.jsonl", FIX
        )
    records = {rank: _step_records(logs[rank]) for rank in sorted(logs)}
    available = sorted({step for by_step in records.values() for step in by_step})
    if not available:
        raise UserError(
            str(folder), 'has no step records with "phases" (each rank\'s phase spans)', FIX
        )
    if steps is None:
        chosen = available[-DEFAULT_STEPS:]
    else:
        chosen = [s for s in available if steps[0] <= s <= steps[1]]
        if not chosen:
            raise UserError(
                "--steps",
                f"{steps[0]}:{steps[1]} holds no step with phases",
                f"the logs hold steps {available[0]}-{available[-1]}",
            )
    lanes = []
    for rank, by_step in records.items():
        drawn = [by_step[s] for s in chosen if s in by_step]
        spans = sorted(
            (span for _, span_list, _ in drawn for span in span_list),
            key=lambda s: (s.start, s.end),
        )
        running = sorted(point for *_, points in drawn for point in points)
        if spans:
            lanes.append(Lane(rank, drawn[-1][0], tuple(spans), tuple(running)))
    return Timeline(tuple(lanes), tuple(chosen), tuple(available))


def format_table(timeline: Timeline) -> str:
    """One line per rank: rank, role, busy s, idle s, idle fraction."""
    lines = [f"{'rank':>4}  {'role':<10} {'busy s':>9} {'idle s':>9} {'idle':>6}"]
    lines += [
        f"{lane.rank:>4}  {lane.role:<10} {lane.busy_s:>9.3f} "
        f"{lane.idle_s:>9.3f} {lane.idle_fraction:>6.1%}"
        for lane in timeline.lanes
    ]
    return "\n".join(lines)


def _step_records(path: Path) -> dict[int, tuple[str, list[Span], list[tuple[float, int]]]]:
    """step -> (role, spans, running batch) of one rank's log; the last record of a repeated step
    wins."""
    out: dict[int, tuple[str, list[Span], list[tuple[float, int]]]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn line from a crash
            continue
        if not isinstance(record, dict) or not isinstance(record.get("phases"), list):
            continue
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        spans = [
            Span(p[0], step, float(p[1]), float(p[2])) for p in record["phases"] if _is_span(p)
        ]
        running = [
            (float(p[0]), int(p[1]))
            for p in record.get("running_rows", [])
            if isinstance(p, list) and len(p) == 2 and all(_is_number(x) for x in p)
        ]
        if spans:
            out.pop(step, None)
            out[step] = (str(record.get("role", "?")), spans, running)
    return out


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_span(entry) -> bool:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
        return False
    times = entry[1:]
    return all(_is_number(t) for t in times) and times[0] <= times[1]


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
