"""The memory timeline (grpo_ds/step/memory_timeline.py): written with the profile, one row per
sample and per phase boundary, peaks per phase that show what a phase allocated, and its plot."""

import csv
import itertools
import json
import re
import time

import pytest
import torch

import grpo_ds.train as train_module
from grpo_ds.config.recipe import LoggingConfig
from grpo_ds.distributed.ranks import Dist
from grpo_ds.step import memory_timeline
from grpo_ds.step.memory_timeline import (
    COLUMNS,
    MIB,
    PhasePeak,
    format_table,
    phase_peaks,
    read_rows,
    spans,
)
from grpo_ds.step.profiling import Phase, memory_path, profiled_steps, trace_path
from tests.launch import REPO

ONE_RANK = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
BIG = 200 * MIB  # bytes of the tensor a test phase allocates


def _loop(run_dir, steps=range(1, 4), body=None, **logging) -> list[bool]:
    """profiled_steps over ``steps`` with a rollout and an update phase per step (``body(step)``
    inside the update); returns, per step, whether torch.profiler was recording."""
    cfg = LoggingConfig(**{"profile_steps": [2, 3], **logging})
    profiling = []
    for step in profiled_steps(steps, cfg, run_dir, ONE_RANK):
        profiling.append(torch.autograd.profiler._is_profiler_enabled)
        with Phase("rollout"):
            torch.ones(16).sum()
        with Phase("update"):
            if body is not None:
                body(step)
    return profiling


def _events(rows, phase: str) -> list[str]:
    return [r.event for r in rows if r.phase == phase and r.event != "sample"]


@pytest.mark.slow
def test_a_profiled_run_writes_the_timeline_of_its_phases(tmp_path, capsys):
    """The tiny recipe, step 2 of 3 profiled (step 1 warms the profiler up and is not in the
    timeline)."""
    # a reference model: the logprob phase has work
    train_module.run(
        str(REPO / "recipes" / "tiny_cpu.json"),
        {
            "run.output_dir": str(tmp_path),
            "train.steps": 3,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "train.micro_batch_samples_per_gpu": 4,
            "logging.progress_bar": False,
            "logging.profile_steps": [2, 2],
            "logging.memory_sample_ms": 2,
            "algorithm.kl_coef": 0.01,
        },
    )
    run_dir = tmp_path / "tiny_cpu"
    path = memory_path(run_dir, 0)
    assert trace_path(run_dir, 0).is_file()
    with path.open() as f:
        assert tuple(next(csv.reader(f))) == COLUMNS
    rows = read_rows(path)
    assert {r.step for r in rows} == {2}
    assert all(a.seconds <= b.seconds for a, b in itertools.pairwise(rows))
    assert rows[0].event == "step" and rows[0].phase == ""
    for phase in ("rollout", "reward", "logprob", "advantage", "update", "sync"):
        assert _events(rows, phase) == ["start", "end"], phase  # once each, boundaries recorded
    assert [s.phase for s in spans(rows)] == [
        "rollout",
        "reward",
        "logprob",
        "advantage",
        "update",
        "sync",
    ]
    assert sum(r.event == "sample" for r in rows) >= 5  # the thread samples between the boundaries
    assert all(
        r.rss > 10 * MIB and 0 < r.rss_anon < r.rss and r.cuda_allocated is None for r in rows
    )
    peaks = phase_peaks(path)
    assert [p.phase for p in peaks] == [
        "rollout",
        "reward",
        "logprob",
        "advantage",
        "update",
        "sync",
    ]
    assert all(p.runs == 1 and p.peak_step == 2 and p.peak_rss >= p.start_rss for p in peaks)
    top = max(rows, key=lambda r: r.rss)
    err = capsys.readouterr().err
    said = re.search(
        r"profile: memory of step 2 sampled every 2 ms to (\S+)/rank\*\.memory\.csv; rank 0's peak "
        r"RSS ([\d.]+) MiB (in \w+|between phases) \(step 2\)",
        err,
    )
    assert said and said[1] == str(path.parent), err
    assert float(said[2]) == pytest.approx(top.rss / MIB, abs=0.05)
    assert said[3] == (f"in {top.phase}" if top.phase else "between phases")


def test_without_the_trace_only_the_timeline_is_recorded(tmp_path):
    assert _loop(tmp_path / "off", profile_trace=False) == [False, False, False]
    assert not trace_path(tmp_path / "off", 0).exists()
    assert {r.step for r in read_rows(memory_path(tmp_path / "off", 0))} == {2, 3}
    # with the trace, the profiler records steps 2-3 (after warming up in step 1), and the timeline
    # covers those
    assert _loop(tmp_path / "on")[1:] == [True, True]
    assert trace_path(tmp_path / "on", 0).is_file()
    assert {r.step for r in read_rows(memory_path(tmp_path / "on", 0))} == {2, 3}
    assert memory_timeline.current() is None  # the range is over: phases report to nothing


def test_a_phase_shorter_than_the_interval_still_has_its_boundary_rows(tmp_path):
    def hold(step):
        if step == 2:
            # float32: BIG bytes, still alive when the phase ends
            hold.tensor = torch.ones(BIG // 4)

    _loop(tmp_path, body=hold, memory_sample_ms=60_000, profile_trace=False)  # no sample in between
    rows = read_rows(memory_path(tmp_path, 0))
    assert [(r.step, r.phase, r.event) for r in rows] == [
        (step, phase, event)
        for step in (2, 3)
        for phase, event in [
            ("", "step"),
            ("rollout", "start"),
            ("rollout", "end"),
            ("update", "start"),
            ("update", "end"),
        ]
    ] + [(3, "", "sample")]  # the last row, when the range ends
    update = {p.phase: p for p in phase_peaks(memory_path(tmp_path, 0))}["update"]
    assert update.runs == 2 and update.peak_step == 2
    assert update.rss_rise >= 0.95 * BIG


def test_the_sampler_catches_a_peak_inside_a_phase(tmp_path):
    def spike(step):
        if step == 3:
            x = torch.ones(BIG // 4)
            time.sleep(0.1)
            del x  # freed before the phase ends: only the thread's samples see it

    _loop(tmp_path, body=spike, memory_sample_ms=5, profile_trace=False)
    peaks = {p.phase: p for p in phase_peaks(memory_path(tmp_path, 0))}
    update, rollout = peaks["update"], peaks["rollout"]
    assert update.peak_step == 3 and update.rss_rise >= 0.95 * BIG
    assert rollout.rss_rise < 0.1 * BIG
    rows = read_rows(memory_path(tmp_path, 0))
    end = next(r for r in rows if (r.step, r.phase, r.event) == (3, "update", "end"))
    assert end.rss < update.peak_rss - 0.9 * BIG  # the end row no longer holds it

    table = format_table(list(peaks.values())).splitlines()
    assert (
        table[0]
        == "| phase | runs | step of peak | RSS at start (MiB) | peak RSS (MiB) | rise (MiB) |"
    )
    cells = table[3].strip("| ").split(" | ")
    assert cells[:3] == ["update", "2", "3"]
    # each rounded to 0.1 MiB: their difference may be 0.15 off
    start, peak, rise = map(float, cells[3:])
    assert (
        rise >= 190
        and peak - start == pytest.approx(rise, abs=0.2)
        and start == pytest.approx(update.start_rss / MIB, abs=0.05)
    )


def test_nested_phases_record_the_inner_name_and_the_outer_run_holds_it(tmp_path):
    def nested(step):
        with Phase("inner"):
            nested.tensor = torch.ones(BIG // 4)

    _loop(tmp_path, steps=range(2, 3), body=nested, memory_sample_ms=60_000, profile_trace=False)
    rows = read_rows(memory_path(tmp_path, 0))
    assert [(r.phase, r.event) for r in rows if r.event in ("start", "end")] == [
        ("rollout", "start"),
        ("rollout", "end"),
        ("update", "start"),
        ("inner", "start"),
        ("inner", "end"),
        ("update", "end"),
    ]
    assert [s.phase for s in spans(rows)] == ["rollout", "update", "inner"]
    peaks = {p.phase: p for p in phase_peaks(memory_path(tmp_path, 0))}
    assert (
        peaks["inner"].rss_rise >= 0.95 * BIG
        and peaks["update"].peak_rss == peaks["inner"].peak_rss
    )


def test_a_loop_that_stops_inside_the_range_keeps_its_rows(tmp_path):
    def fail(step):
        if step == 3:
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        _loop(tmp_path, body=fail, profile_trace=False)
    rows = read_rows(memory_path(tmp_path, 0))
    assert rows[-1].step == 3 and _events(rows, "update") == ["start", "end", "start", "end"]
    assert memory_timeline.current() is None


def test_host_memory_and_its_fallbacks_agree():
    rss, anon = memory_timeline.host_memory()
    assert 10 * MIB < rss and 0 < anon < rss
    assert memory_timeline._psutil()[0] == pytest.approx(rss, rel=0.1)
    # the peak so far: not below what is resident now
    assert memory_timeline._rusage_peak()[0] >= 0.9 * rss


def _write_cuda_timeline(run_dir) -> None:
    """A timeline as a GPU rank writes one: CUDA columns filled."""
    path = memory_path(run_dir, 1)
    path.parent.mkdir(parents=True)
    gib = 2**30
    rows = [
        (0.0, 2, "", "step"),
        (0.001, 2, "update", "start"),
        (0.01, 2, "update", "sample"),
        (0.02, 2, "update", "end"),
        (0.03, 2, "sync", "start"),
        (0.04, 2, "sync", "end"),
    ]
    allocated = [1 * gib, 1 * gib, 3 * gib, 2 * gib, 2 * gib, 2 * gib]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for (s, step, phase, event), a in zip(rows, allocated, strict=True):
            out.writerow([s, step, phase, event, 4 * gib, 3 * gib, a, 4 * gib])


def test_cuda_columns_give_cuda_peaks(tmp_path):
    _write_cuda_timeline(tmp_path)
    peaks = phase_peaks(memory_path(tmp_path, 1))
    assert peaks[0] == PhasePeak("update", 1, 2, 4 * 2**30, 4 * 2**30, 2**30, 3 * 2**30, 4 * 2**30)
    table = format_table(peaks).splitlines()
    assert table[0].endswith(
        "| CUDA allocated at start (MiB) | peak CUDA allocated (MiB) | peak CUDA reserved (MiB) |"
    )
    assert table[2].endswith("| 1024.0 | 3072.0 | 4096.0 |")


def test_the_plot_draws_memory_phases_and_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from grpo_ds.plot import make_memory_figure, plot_memory

    _loop(tmp_path, memory_sample_ms=5, profile_trace=False)
    (tmp_path / "recipe.json").write_text(json.dumps({"run": {"name": "demo"}}))
    fig = make_memory_figure(tmp_path)
    (ax,) = fig.axes
    assert fig.get_suptitle() == "demo: memory of rank 0, steps 2-3"
    assert (
        ax.get_title() == "host memory (MiB)"
        and ax.get_xlabel() == "seconds since the first profiled step"
    )
    assert [
        line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")
    ] == ["RSS", "RssAnon"]
    rss = ax.get_lines()[0].get_ydata()
    assert rss.max() == pytest.approx(max(r.rss for r in read_rows(memory_path(tmp_path, 0))) / MIB)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "RSS",
        "RssAnon",
        "rollout",
        "update",
    ]
    assert [t.get_text() for t in ax.texts if "step" in t.get_text()] == [" step 2", " step 3"]
    out = plot_memory(tmp_path)
    assert out == tmp_path / "memory.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    _write_cuda_timeline(tmp_path / "gpu")
    fig = make_memory_figure(tmp_path / "gpu", rank=1)
    assert [ax.get_title() for ax in fig.axes] == ["host memory (MiB)", "CUDA memory (MiB)"]
    assert [line.get_label() for line in fig.axes[1].get_lines()][:2] == ["allocated", "reserved"]
    assert plot_memory(tmp_path / "gpu", rank=1) == tmp_path / "gpu" / "memory_rank1.png"


def test_every_row_belongs_to_the_step_the_timeline_started_in():
    """The first step's row is written before the sampling thread runs: a sample taken between the
    thread's start and the step's row was counted in step 0
    (test_a_profiled_run_writes_the_timeline_of_its_phases failed that way now and then on a loaded
    machine)."""
    timeline = memory_timeline.MemoryTimeline(1e-5, torch.device("cpu"))
    timeline.start(7)
    time.sleep(0.02)
    timeline.stop()
    rows = timeline.rows()
    assert rows[0].event == "step" and {r.step for r in rows} == {7}
    assert sum(r.event == "sample" for r in rows) >= 2
