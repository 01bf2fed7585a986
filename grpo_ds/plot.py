"""Training curves from a run folder's metrics.jsonl, drawn into one PNG; or the memory timeline of
profiled steps; or each rank's phases over wall time.

    python -m grpo_ds.plot RUN_DIR [--out FILE.png] [--smooth N] [--keys k1,k2,...]
    python -m grpo_ds.plot RUN_DIR --memory [--rank R] [--out FILE.png]
    python -m grpo_ds.plot RUN_DIR --timeline [--steps FIRST:LAST] [--out FILE.png]

One panel per curve: reward (mean with a +-std band, plus ``reward/NAME`` per function), response
length, KL, entropy, clip fraction, grad norm, loss, per-phase timings (stacked; their sum is
``time_step_s``) and tokens/s. Panels whose keys the file lacks are skipped. The file is read the
way a crash or a resume leaves it: unreadable lines (a torn last line) are skipped, and when a step
appears more than once its last record wins.

``--memory`` draws ``profile/rank<R>.memory.csv`` (grpo_ds.step.memory_timeline, written with
``logging.profile_steps``) over seconds: RSS and RssAnon, and CUDA allocated and reserved below them
on a GPU, in MiB, each phase's runs shaded and named, the steps' starts marked.

``--timeline`` draws ``ranks/rank<r>.jsonl`` (grpo_ds.run.timeline): one lane per rank, each phase a
coloured bar over wall time, ``wait`` (idle) hatched grey, each step's start marked; the last
20 steps unless ``--steps`` says otherwise. Under the picture's path it prints each rank's busy and
idle seconds.

matplotlib draws off-screen (a Figure on the Agg canvas; pyplot and its global backend are never
touched).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from grpo_ds.errors import UserError, exit_on_user_error
from grpo_ds.run.curves import Panel as Panel  # re-exported: grpo_ds.plot's callers use it
from grpo_ds.run.curves import draw_panel, numeric_keys, panels
from grpo_ds.run.curves import moving_average as moving_average  # re-exported, as Panel
from grpo_ds.run.metrics import read_metrics
from grpo_ds.run.timeline import IDLE, Timeline, format_table, parse_steps, read_timeline
from grpo_ds.step.memory_timeline import MIB, Row, read_rows, spans
from grpo_ds.step.profiling import memory_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLUMNS = 3  # panels per row
PANEL_INCHES = (4.8, 3.2)  # width, height of one panel
TITLE_INCHES = 0.4  # room for the figure title
DPI = 100
MEMORY_INCHES = (12.0, 3.6)  # width, height of a memory panel
# width, height of one rank's lane, room for the title, axis and legend
TIMELINE_INCHES = (12.0, 0.6, 1.6)
RUNNING_INCHES = 1.8  # the running batch's panel under the lanes (continuous generation)
# the loop's phases in its order, each a colour of its own; any other phase gets a light one of
# tab20's
PHASE_COLORS = {
    phase: f"C{i}"
    for i, phase in enumerate(
        (
            "rollout",
            "reward",
            "logprob",
            "advantage",
            "update",
            "sync",
            "eval",
            "checkpoint",
            "send",
            "recv",
        )
    )
}


def make_figure(run_dir: str | Path, smooth: int = 1, keys: Sequence[str] | None = None) -> Figure:
    """The matplotlib Figure (Agg canvas) for a run folder: one axes per entry of ``panels``."""
    if smooth < 1:
        raise UserError(
            "--smooth", f"{smooth} is out of range: must be >= 1", "use 1 for no smoothing"
        )
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    chosen = panels(numeric_keys(records), keys)
    figure_class, canvas_class = _matplotlib()

    cols = min(COLUMNS, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig = figure_class(
        figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows + TITLE_INCHES),
        dpi=DPI,
        layout="constrained",
    )
    canvas_class(fig)  # Agg: renders off-screen, no display needed
    steps = [r["step"] for r in records]
    fig.suptitle(
        f"{run_name(run_dir)}: steps {steps[0]}-{steps[-1]}"
        + (f", smoothed over {smooth}" if smooth > 1 else "")
    )
    for i, panel in enumerate(chosen):
        ax = fig.add_subplot(rows, cols, i + 1)
        draw_panel(ax, panel, records, smooth)
    return fig


def plot_run(
    run_dir: str | Path,
    out: str | Path | None = None,
    smooth: int = 1,
    keys: Sequence[str] | None = None,
) -> Path:
    """Draw a run folder's curves into ``out`` (default RUN_DIR/curves.png); return the path
    written."""
    return _save(
        make_figure(run_dir, smooth, keys),
        Path(out) if out is not None else Path(run_dir) / "curves.png",
    )


def make_memory_figure(run_dir: str | Path, rank: int = 0) -> Figure:
    """The Figure (Agg canvas) of rank ``rank``'s memory timeline: host memory, and CUDA memory
    below it on a GPU."""
    run_dir = Path(run_dir)
    rows = read_rows(memory_path(run_dir, rank))
    if not rows:
        raise UserError(
            str(memory_path(run_dir, rank)),
            "has no rows",
            "a profiled range writes them when it ends",
        )
    charts = [
        (
            "host memory (MiB)",
            {"RSS": [r.rss for r in rows], "RssAnon": [r.rss_anon for r in rows]},
        ),
        (
            "CUDA memory (MiB)",
            {
                "allocated": [r.cuda_allocated for r in rows],
                "reserved": [r.cuda_reserved for r in rows],
            },
        ),
    ]
    charts = [(title, {k: v for k, v in lines.items() if None not in v}) for title, lines in charts]
    charts = [(title, lines) for title, lines in charts if lines]
    figure_class, canvas_class = _matplotlib()
    fig = figure_class(
        figsize=(MEMORY_INCHES[0], MEMORY_INCHES[1] * len(charts) + TITLE_INCHES),
        dpi=DPI,
        layout="constrained",
    )
    canvas_class(fig)
    steps = sorted({r.step for r in rows})
    fig.suptitle(
        f"{run_name(run_dir)}: memory of rank {rank}, "
        + (f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}")
    )
    axes = fig.subplots(len(charts), 1, sharex=True, squeeze=False)[:, 0]
    seconds = np.array([r.seconds for r in rows])
    for ax, (title, lines) in zip(axes, charts, strict=True):
        for (label, values), style in zip(lines.items(), ("-", "--"), strict=False):
            ax.plot(
                seconds,
                np.array(values, dtype=float) / MIB,
                style,
                color="black",
                linewidth=1.2,
                label=label,
            )
        ax.set_title(title)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        _mark_phases_and_steps(ax, rows, labelled=ax is axes[0])
    axes[-1].set_xlabel("seconds since the first profiled step")
    return fig


def plot_memory(run_dir: str | Path, out: str | Path | None = None, rank: int = 0) -> Path:
    """Draw rank ``rank``'s memory timeline into ``out`` (default RUN_DIR/memory.png,
    memory_rank<R>.png for rank R > 0); return the path written."""
    default = Path(run_dir) / ("memory.png" if rank == 0 else f"memory_rank{rank}.png")
    return _save(make_memory_figure(run_dir, rank), Path(out) if out is not None else default)


def make_timeline_figure(timeline: Timeline, name: str) -> Figure:
    """The Figure (Agg canvas) of ``timeline``: a lane per rank, rank 0 on top, its phases as bars
    over seconds since the earliest span drawn; ``name`` heads the title."""
    figure_class, canvas_class = _matplotlib()

    lanes, steps, available = timeline.lanes, timeline.steps, timeline.available
    running = [lane for lane in lanes if lane.running]  # continuous generation's rollout ranks
    lanes_inches = TIMELINE_INCHES[1] * len(lanes) + TIMELINE_INCHES[2]
    fig = figure_class(
        figsize=(TIMELINE_INCHES[0], lanes_inches + (RUNNING_INCHES if running else 0.0)),
        dpi=DPI,
        layout="constrained",
    )
    canvas_class(fig)
    shown = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    if len(steps) < len(available):
        last = steps == available[-len(steps) :]
        shown += (
            f" ({'the last ' if last else ''}{len(steps)} of "
            f"{len(available)}; --steps FIRST:LAST for others)"
        )
    fig.suptitle(f"{name}: phases per rank over wall time, {shown}")
    if running:
        ax, below = fig.subplots(
            2, 1, sharex=True, height_ratios=[lanes_inches - TIMELINE_INCHES[2], RUNNING_INCHES]
        )
    else:
        ax = fig.add_subplot()
    _draw_lanes(fig, ax, lanes, timeline.origin)
    ax.set_yticks(range(len(lanes)), [f"rank {lane.rank} ({lane.role})" for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # rank 0 on top
    ax.grid(axis="x", alpha=0.3)
    if running:
        _draw_running(below, running, timeline.origin)
        ax = below
    ax.set_xlabel("seconds since the first span drawn (dotted: a step's first span on that rank)")
    return fig


def _draw_lanes(fig, ax, lanes, origin: float) -> None:
    """A lane per rank: its phases as bars (idle hatched), a dotted line where each step starts on
    it; the legend, one entry a phase."""
    from matplotlib import colormaps

    phases = list(dict.fromkeys(s.phase for lane in lanes for s in lane.spans))
    others = [p for p in phases if p not in PHASE_COLORS and p != IDLE]
    colors = {**PHASE_COLORS, **{p: colormaps["tab20"](2 * i + 1) for i, p in enumerate(others)}}
    for y, lane in enumerate(lanes):
        for phase in phases:
            bars = [(s.start - origin, s.end - s.start) for s in lane.spans if s.phase == phase]
            style = (
                dict(facecolor="0.88", edgecolor="0.45", hatch="///", linewidth=0.5)
                if phase == IDLE
                else dict(facecolor=colors[phase], linewidth=0)
            )
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), label=phase, **style)
        starts = {}  # each step's first span on this lane
        for s in lane.spans:
            starts.setdefault(s.step, s.start - origin)
        ax.vlines(
            list(starts.values()), y - 0.45, y + 0.45, colors="0.5", linestyles=":", linewidth=0.8
        )
        for step, x in starts.items():
            ax.text(x, y - 0.42, f" {step}", fontsize="x-small", color="0.4", va="bottom")
    # one entry a phase
    handles = {label: h for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    order = [p for p in (*PHASE_COLORS, *others, IDLE) if p in handles]
    fig.legend(
        [handles[p] for p in order],
        order,
        loc="outside lower center",
        ncols=min(len(order), 11),
        fontsize="small",
    )


def _draw_running(ax, lanes, origin: float) -> None:
    """Continuous generation's running batch over time, a line per rollout rank."""
    for lane in lanes:
        ax.plot(
            [t - origin for t, _ in lane.running],
            [rows for _, rows in lane.running],
            drawstyle="steps-post",
            label=f"rank {lane.rank}",
        )
    ax.set_ylabel("rows in flight")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def plot_timeline(
    run_dir: str | Path, out: str | Path | None = None, steps: tuple[int, int] | None = None
) -> Path:
    """Draw the ranks' phases of steps ``first..last`` (default: the last 20) into ``out`` (default
    RUN_DIR/timeline.png); return the path written. grpo_ds.run.timeline.read_timeline gives the
    busy/idle figures."""
    run_dir = Path(run_dir)
    figure = make_timeline_figure(read_timeline(run_dir, steps), run_name(run_dir))
    return _save(figure, Path(out) if out is not None else run_dir / "timeline.png")


def _mark_phases_and_steps(ax, rows: list[Row], labelled: bool) -> None:
    """Each phase run shaded in its phase's colour (named in the legend, and on the span where it is
    wide enough); a dotted line where each step starts, named on the top panel."""
    runs = spans(rows)
    colors = {phase: f"C{i % 10}" for i, phase in enumerate(dict.fromkeys(s.phase for s in runs))}
    width = (rows[-1].seconds - rows[0].seconds) or 1.0
    named = set()
    for span in runs:
        start, end = rows[span.first].seconds, rows[span.last].seconds
        ax.axvspan(
            start,
            end,
            color=colors[span.phase],
            alpha=0.2,
            linewidth=0,
            label=None if span.phase in named else span.phase,
        )
        named.add(span.phase)
        if labelled and end - start > 0.04 * width:
            ax.text(
                (start + end) / 2,
                0.9,
                span.phase,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize="small",
                color=colors[span.phase],
            )
    for row in rows:
        if row.event == "step":
            ax.axvline(row.seconds, color="gray", linestyle=":", linewidth=1.0)
            if labelled:
                ax.text(
                    row.seconds,
                    0.98,
                    f" step {row.step}",
                    transform=ax.get_xaxis_transform(),
                    va="top",
                    fontsize="small",
                    color="gray",
                )
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _save(fig: Figure, out: Path) -> Path:
    if not out.parent.is_dir():
        raise UserError(
            "--out", f"folder {out.parent} does not exist", "create it first or write elsewhere"
        )
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in fig.canvas.get_supported_filetypes():
        raise UserError(
            "--out",
            f"{out.name}: unknown image format {out.suffix or '(no suffix)'!r}",
            "end the name with .png",
        )
    fig.savefig(out, dpi=DPI)
    return out


def run_name(run_dir: Path) -> str:
    """run.name from RUN_DIR/recipe.json, or the folder's name when that is missing or
    unreadable."""
    try:
        name = json.loads((run_dir / "recipe.json").read_text())["run"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        name = None
    return name if isinstance(name, str) and name else run_dir.resolve().name


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise UserError(
            "grpo_ds.plot",
            f"needs matplotlib, which is not installed ({err.name or err})",
            "pip install matplotlib",
        ) from None
    return Figure, FigureCanvasAgg


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_ds.plot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "run_dir", help="run folder (run.output_dir/run.name) holding metrics.jsonl"
    )
    parser.add_argument("--out", help="image to write (default RUN_DIR/curves.png)")
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        help="moving average over N steps; the raw curve stays "
        "faint behind (default 1: no smoothing)",
    )
    parser.add_argument(
        "--keys", help="comma-separated metric keys to plot (default: every standard curve)"
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="draw the memory timeline of the profiled steps "
        "(RUN_DIR/profile/rank<R>.memory.csv, from logging.profile_steps) instead, into "
        "RUN_DIR/memory.png",
    )
    parser.add_argument("--rank", type=int, help="with --memory: whose timeline (default 0)")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="draw each rank's phases over wall time "
        "(RUN_DIR/ranks/rank<r>.jsonl) instead, into RUN_DIR/timeline.png, and print each rank's "
        "busy and idle seconds",
    )
    parser.add_argument(
        "--steps",
        metavar="FIRST:LAST",
        help="with --timeline: the steps to draw, both included (default: the last 20)",
    )
    return parser


def _print_timeline(args: argparse.Namespace) -> None:
    """--timeline: draw the ranks' phases, print the picture's path and each rank's busy and idle
    seconds."""
    if args.memory or args.rank is not None or args.keys is not None or args.smooth != 1:
        raise UserError(
            "--timeline",
            "draws the ranks' phases; --memory, --rank, --keys and --smooth are "
            "for the other pictures",
            "leave them out",
        )
    run_dir = Path(args.run_dir)
    timeline = read_timeline(run_dir, None if args.steps is None else parse_steps(args.steps))
    out = Path(args.out) if args.out is not None else run_dir / "timeline.png"
    print(_save(make_timeline_figure(timeline, run_name(run_dir)), out))
    print(format_table(timeline))


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    with exit_on_user_error():
        if args.timeline:
            _print_timeline(args)
            return
        if args.steps is not None:
            raise UserError("--steps", "chooses the steps --timeline draws", "add --timeline")
        if args.memory:
            if args.keys is not None or args.smooth != 1:
                raise UserError(
                    "--memory",
                    "draws the memory timeline; --keys and --smooth are for the curves",
                    "leave them out",
                )
            print(plot_memory(args.run_dir, args.out, args.rank or 0))
            return
        if args.rank is not None:
            raise UserError(
                "--rank", "chooses whose memory timeline --memory draws", "add --memory"
            )
        keys = None if args.keys is None else [k.strip() for k in args.keys.split(",") if k.strip()]
        print(plot_run(args.run_dir, args.out, args.smooth, keys))


if __name__ == "__main__":
    main()
