"""grpo_ds.plot: metrics.jsonl written by hand (no training) -> panels, a PNG, and the one-line CLI
errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_ds.errors import UserError
from grpo_ds.plot import (
    PANEL_INCHES,
    RUNNING_INCHES,
    TIMELINE_INCHES,
    TITLE_INCHES,
    Panel,
    main,
    make_figure,
    make_timeline_figure,
    moving_average,
    panels,
    plot_run,
    plot_timeline,
)
from grpo_ds.run.metrics import read_metrics
from grpo_ds.run.timeline import read_timeline
from tests.run.test_timeline import write_logs

matplotlib_image = pytest.importorskip("matplotlib.image")

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PHASES = ("rollout", "reward", "logprob", "update", "sync")


def _record(step: int, **extra) -> dict:
    """A full record as the trainer writes one, with two reward functions."""
    times = {f"time_{p}_s": 0.1 * (i + 1) for i, p in enumerate(PHASES)}
    return {
        "step": step,
        "reward_mean": step / 10,
        "reward_std": 0.05,
        "reward/exact": step / 20,
        "reward/format": 1.0,
        "reward_errors/exact": 0,
        "loss": 0.1 / step,
        "kl": 0.001 * step,
        "entropy": 2.0,
        "clip_frac": 0.01,
        "grad_norm": 0.5,
        "lr": 1e-3,
        "response_len_mean": 12.5,
        "tokens_per_s": 900.0,
        "generated_tokens_per_s": 3000.0,
        "time_step_s": sum(times.values()),
        **times,
        **extra,
    }


def _run(tmp_path: Path, records: list[dict], tail: str = "", name: str | None = "demo") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if name is not None:
        (run / "recipe.json").write_text(json.dumps({"run": {"name": name}}))
    return run


STANDARD = [
    "reward",
    "response length (tokens)",
    "KL",
    "entropy",
    "clip fraction",
    "grad norm",
    "loss",
    "time per step (s)",
    "tokens / s",
]


def test_png_has_a_panel_per_curve(tmp_path):
    run = _run(tmp_path, [_record(s) for s in range(1, 9)])
    out = plot_run(run, smooth=3)
    assert out == run / "curves.png" and out.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib_image.imread(out).shape[:2]
    assert (width, height) == (
        round(3 * PANEL_INCHES[0] * 100),
        round(3 * PANEL_INCHES[1] * 100 + TITLE_INCHES * 100),
    )

    chosen = panels(json.loads((run / "metrics.jsonl").read_text().splitlines()[0]))
    assert [p.title for p in chosen] == STANDARD
    assert chosen[0] == Panel(
        "reward", ("reward_mean", "reward/exact", "reward/format"), band="reward_std"
    )
    assert chosen[7] == Panel(
        "time per step (s)", ("time_step_s",), stack=tuple(f"time_{p}_s" for p in PHASES)
    )
    fig = make_figure(run, smooth=3)
    assert len(fig.axes) == len(chosen) and [ax.get_title() for ax in fig.axes] == STANDARD
    assert fig.get_suptitle() == "demo: steps 1-8, smoothed over 3"


def test_absent_keys_get_no_panel(tmp_path):
    run = _run(
        tmp_path,
        [{"step": s, "reward_mean": 0.1 * s, "loss": 1.0, "note": "text"} for s in (1, 2, 3)],
        name=None,
    )
    assert panels(["reward_mean", "loss"]) == [
        Panel("reward", ("reward_mean",)),
        Panel("loss", ("loss",)),
    ]
    fig = make_figure(run)
    # no recipe.json: the folder's name
    assert len(fig.axes) == 2 and fig.get_suptitle() == "run: steps 1-3"
    out = plot_run(run, out=tmp_path / "two.png")
    height, width = matplotlib_image.imread(out).shape[:2]
    assert (width, height) == (
        round(2 * PANEL_INCHES[0] * 100),
        round((PANEL_INCHES[1] + TITLE_INCHES) * 100),
    )


def test_keys_narrow_the_panels_and_add_others():
    available = _record(1).keys() - {"step"}
    chosen = panels(available, ["lr", "reward_mean", "time_update_s"])
    assert chosen == [
        Panel("reward", ("reward_mean",), band="reward_std"),
        Panel("time per step (s)", (), stack=("time_update_s",)),
        Panel("lr", ("lr",)),
    ]
    # no mean: a line of its own
    assert panels(available, ["reward_std"]) == [Panel("reward_std", ("reward_std",))]
    with pytest.raises(
        UserError,
        match=r"--keys: unknown key 'rewrd_mean'. did you mean 'reward_mean'\? "
        r"available: clip_frac, entropy, ",
    ):
        panels(available, ["rewrd_mean"])


def test_resumed_steps_keep_the_last_record_and_a_torn_line_is_skipped(tmp_path):
    first = [_record(s) for s in (1, 2, 3)]
    # restarted from the step-1 checkpoint
    resumed = [_record(s, loss=-float(s)) for s in (2, 3, 4)]
    run = _run(tmp_path, first + resumed, tail='{"step": 5, "reward_me')  # then crashed mid-write
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == [0.1, -2.0, -3.0, -4.0]
    assert len(make_figure(run).axes) == len(STANDARD)


def test_moving_average_is_trailing_and_skips_nan():
    got = moving_average(np.array([1.0, 3.0, np.nan, 5.0, 7.0]), 2)
    np.testing.assert_allclose(got, [1.0, 2.0, 3.0, 5.0, 6.0])
    np.testing.assert_array_equal(moving_average(np.array([1.0, 2.0]), 1), [1.0, 2.0])


def _cli_cases(tmp_path: Path) -> dict:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "reward_me')  # only a torn line
    (empty / "ranks").mkdir()
    (empty / "ranks" / "rank0.jsonl").write_text(
        json.dumps({"step": 1, "trained_sample_ids": [0, 1]}) + "\n"
    )
    parent = tmp_path / "runs"
    (parent / "mine").mkdir(parents=True)
    (parent / "mine" / "metrics.jsonl").write_text(json.dumps(_record(1)) + "\n")
    return {
        "missing_folder": (
            [str(tmp_path / "nope")],
            f"error: {tmp_path / 'nope'}: not found. give a run folder",
        ),
        "no_metrics": (
            [str(parent)],
            f"error: {parent / 'metrics.jsonl'}: not found. did you mean {parent / 'mine'}?",
        ),
        "empty": ([str(empty)], f"error: {empty / 'metrics.jsonl'}: has no complete records."),
        "unknown_key": (
            [str(parent / "mine"), "--keys", "reward_mean,nope"],
            "error: --keys: unknown key 'nope'. available: "
            "clip_frac, entropy, generated_tokens_per_s,",
        ),
        "smooth": (
            [str(parent / "mine"), "--smooth", "0"],
            "error: --smooth: 0 is out of range: must be >= 1.",
        ),
        "out_folder": (
            [str(parent / "mine"), "--out", str(tmp_path / "no" / "x.png")],
            f"error: --out: folder {tmp_path / 'no'} does not exist.",
        ),
        "no_timeline": (
            [str(parent / "mine"), "--memory"],
            f"error: {parent / 'mine' / 'profile' / 'rank0.memory.csv'}"
            ": not found. logging.profile_steps=[first, last] writes the memory timeline",
        ),
        "memory_keys": (
            [str(parent / "mine"), "--memory", "--keys", "loss"],
            "error: --memory: draws the memory "
            "timeline; --keys and --smooth are for the curves. leave them out.",
        ),
        "rank_alone": (
            [str(parent / "mine"), "--rank", "1"],
            "error: --rank: chooses whose memory timeline --memory draws. add --memory.",
        ),
        "no_ranks": (
            [str(parent / "mine"), "--timeline"],
            f"error: {parent / 'mine' / 'ranks'}: not found. a run made "
            "by this version of grpo_ds.train writes them (RUN_DIR/ranks/rank<r>.jsonl).",
        ),
        "no_phases": (
            [str(empty), "--timeline"],
            f'error: {empty / "ranks"}: has no step records with "phases"',
        ),
        "steps_form": (
            [str(empty), "--timeline", "--steps", "4"],
            "error: --steps: '4' is not FIRST:LAST.",
        ),
        "steps_alone": (
            [str(empty), "--steps", "1:2"],
            "error: --steps: chooses the steps --timeline draws.",
        ),
        "timeline_memory": (
            [str(empty), "--timeline", "--memory"],
            "error: --timeline: draws the ranks' phases;",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing_folder",
        "no_metrics",
        "empty",
        "unknown_key",
        "smooth",
        "out_folder",
        "no_timeline",
        "memory_keys",
        "rank_alone",
        "no_ranks",
        "no_phases",
        "steps_form",
        "steps_alone",
        "timeline_memory",
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, case):
    argv, start = _cli_cases(tmp_path)[case]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(start) and err.count("\n") == 1, err


def test_without_matplotlib_says_pip_install(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path, [_record(1)])
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import of any of them now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        main([str(run)])
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2
        and err.count("\n") == 1
        and err.rstrip().endswith("pip install matplotlib.")
    ), err
    assert not (run / "curves.png").exists()


def test_module_runs_as_a_command(tmp_path):
    run = _run(tmp_path, [_record(s) for s in (1, 2)])
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_ds.plot",
            str(run),
            "--keys",
            "reward_mean,lr",
            "--out",
            str(tmp_path / "c.png"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "c.png"), ok.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    bad = subprocess.run(
        [sys.executable, "-m", "grpo_ds.plot", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert (
        bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")
    ), bad.stderr


def test_timeline_png_has_a_lane_per_rank(tmp_path, capsys):
    run = write_logs(tmp_path / "run")
    out = plot_timeline(run)
    assert out == run / "timeline.png" and out.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib_image.imread(out).shape[:2]
    lanes_inches = 3 * TIMELINE_INCHES[1] + TIMELINE_INCHES[2]
    assert (width, height) == (round(TIMELINE_INCHES[0] * 100), round(lanes_inches * 100))
    fig = make_timeline_figure(read_timeline(run), "demo")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 (trainer)",
        "rank 1 (trainer)",
        "rank 2 (rollout)",
    ]
    assert fig.get_suptitle() == "demo: phases per rank over wall time, steps 1-2"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "rollout",
        "reward",
        "logprob",
        "update",
        "sync",
        "send",
        "recv",
        "wait",
    ]
    wait = [c for c in ax.collections if c.get_label() == "wait"]
    # idle stands out: hatched, on every lane
    assert len(wait) == 3 and all(c.get_hatch() == "///" for c in wait)
    # seconds since the earliest span drawn
    assert ax.get_xlim()[0] <= 0 and ax.get_xlim()[1] >= 9.5

    main([str(run), "--timeline", "--steps", "2:2", "--out", str(tmp_path / "t.png")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0
    assert lines[1:] == [
        "rank  role          busy s    idle s   idle",
        "   0  trainer        3.500     0.000   0.0%",
        "   1  trainer        3.500     0.000   0.0%",
        "   2  rollout        2.250     1.750  43.8%",
    ]


def test_timeline_title_says_when_it_draws_the_last_20(tmp_path):
    timeline = read_timeline(write_logs(tmp_path / "run", range(1, 26)))
    fig = make_timeline_figure(timeline, "demo")
    assert fig.get_suptitle() == (
        "demo: phases per rank over wall time, steps 6-25 (the last 20 of 25; --steps "
        "FIRST:LAST for others)"
    )


def test_a_continuous_runs_timeline_draws_the_running_batch_under_the_lanes(tmp_path):
    run = write_logs(tmp_path / "run")
    log = run / "ranks" / "rank2.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        if line.get("phases") and line.get("role") == "rollout":
            start = line["phases"][0][1]
            line["running_rows"] = [[start, 8], [start + 1, 16], [start + 2, 4]]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    fig = make_timeline_figure(read_timeline(run), "demo")
    lanes, below = fig.axes
    assert [t.get_text() for t in lanes.get_yticklabels()][-1] == "rank 2 (rollout)"
    (line,) = below.get_lines()
    assert line.get_label() == "rank 2" and list(line.get_ydata()) == [8, 16, 4, 8, 16, 4]
    assert below.get_ylabel() == "rows in flight" and below.get_xlabel().startswith("seconds")
    out = plot_timeline(run)
    height = matplotlib_image.imread(out).shape[0]
    assert height == round((3 * TIMELINE_INCHES[1] + TIMELINE_INCHES[2] + RUNNING_INCHES) * 100)
