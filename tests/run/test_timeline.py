"""grpo_ds.run.timeline: per-rank logs written by hand (the plot's input is a file format) -> lanes,
busy/idle."""

import json
from pathlib import Path

import pytest

from grpo_ds.errors import UserError
from grpo_ds.run.timeline import format_table, parse_steps, read_timeline

# epoch seconds; every offset below is a multiple of 1/4, so the sums are exact in floats
T0 = 1764225000.0

# Split placement at staleness 1: the rollout rank (2) makes step 2's samples while the trainers
# train on step 1's.
# 5.5-6: a gap
TRAINER = {
    1: [
        ["wait", 0, 2],
        ["recv", 2, 2.25],
        ["logprob", 2.25, 3],
        ["update", 3, 5],
        ["sync", 5, 5.5],
    ],
    2: [["recv", 6, 6.25], ["logprob", 6.25, 7], ["update", 7, 9], ["sync", 9, 9.5]],
}
# overlap, gap
ROLLOUT = {
    1: [["rollout", 0, 1.75], ["reward", 1.75, 2], ["send", 2, 2.25]],
    2: [["rollout", 2.25, 4], ["reward", 3.75, 4.25], ["wait", 4.25, 5.5], ["send", 6, 6.25]],
}
# trainer: window 0-9.5, busy 2 x (0.25 + 0.75 + 2 + 0.5) = 7, idle = wait 2 + gap 0.5
# rollout: window 0-6.25, busy 2.25 + [2.25, 4.25] + 0.25 = 4.5 (the overlap once), idle = wait
# 1.25 + gap 0.5
EXPECTED = [
    (0, "trainer", 7.0, 2.5, 2.5 / 9.5),
    (1, "trainer", 7.0, 2.5, 2.5 / 9.5),
    (2, "rollout", 4.5, 1.75, 1.75 / 6.25),
]


def record(step: int, role: str, spans: list, **extra) -> dict:
    return {
        "step": step,
        "role": role,
        "phases": [[name, T0 + a, T0 + b] for name, a, b in spans],
        **extra,
    }


def write_logs(run: Path, steps: range = range(1, 3)) -> Path:
    """RUN/ranks/rank{0,1,2}.jsonl as a split run writes them, with what a reader must skip: other
    records, a step logged twice (resumed: the last wins), a torn last line."""
    ranks = run / "ranks"
    ranks.mkdir(parents=True)
    for rank in (0, 1, 2):
        role, phases = ("rollout", ROLLOUT) if rank == 2 else ("trainer", TRAINER)
        # steps 3 and 4 repeat steps 1 and 2 10 s later, and so on
        shifted = {
            s: [
                [n, a + 10 * ((s - 1) // 2), b + 10 * ((s - 1) // 2)]
                for n, a, b in phases[1 + (s - 1) % 2]
            ]
            for s in steps
        }
        # a crashed attempt at step 1
        lines = [record(1, role, [["update", 0, 100]])] if rank == 1 else []
        lines += [record(s, role, shifted[s], trained_sample_ids=[s]) for s in steps]
        lines += [{"step": 1, "trained_sample_ids": [0, 1]}, {"final_weights_sha256": "ab" * 32}]
        text = "".join(json.dumps(line) + "\n" for line in lines)
        (ranks / f"rank{rank}.jsonl").write_text(
            text + ('{"step": 3, "role": "tra' if rank == 0 else "")
        )
    return run


def _numbers(timeline) -> list[tuple]:
    return [
        (lane.rank, lane.role, lane.busy_s, lane.idle_s, lane.idle_fraction)
        for lane in timeline.lanes
    ]


def test_busy_and_idle_seconds_are_exact(tmp_path):
    timeline = read_timeline(write_logs(tmp_path / "run"))
    assert _numbers(timeline) == EXPECTED
    assert timeline.steps == timeline.available == (1, 2) and timeline.origin == T0
    spans = timeline.lanes[1].spans  # rank 1: the repeated step 1's last record, in start order
    assert len(spans) == 9 and [(s.phase, s.step, s.start - T0) for s in spans[:3]] == [
        ("wait", 1, 0),
        ("recv", 1, 2),
        ("logprob", 1, 2.25),
    ]
    assert format_table(timeline).splitlines() == [
        "rank  role          busy s    idle s   idle",
        "   0  trainer        7.000     2.500  26.3%",
        "   1  trainer        7.000     2.500  26.3%",
        "   2  rollout        4.500     1.750  28.0%",
    ]


def test_steps_choose_the_spans(tmp_path):
    run = write_logs(tmp_path / "run")
    only_two = read_timeline(run, (2, 2))
    # trainer step 2: window 6-9.5, all busy; rollout step 2: window 2.25-6.25, wait 1.25 + gap 0.5
    assert _numbers(only_two) == [
        (0, "trainer", 3.5, 0.0, 0.0),
        (1, "trainer", 3.5, 0.0, 0.0),
        (2, "rollout", 2.25, 1.75, 1.75 / 4),
    ]
    assert only_two.steps == (2,) and only_two.origin == T0 + 2.25
    with pytest.raises(
        UserError, match=r"^--steps: 5:9 holds no step with phases. the logs hold steps 1-2\.$"
    ):
        read_timeline(run, (5, 9))


def test_more_than_20_steps_draw_the_last_20(tmp_path):
    timeline = read_timeline(write_logs(tmp_path / "run", range(1, 26)))
    assert timeline.steps == tuple(range(6, 26)) and timeline.available == tuple(range(1, 26))
    assert {s.step for lane in timeline.lanes for s in lane.spans} == set(range(6, 26))


@pytest.mark.parametrize(("text", "bounds"), [("3:7", (3, 7)), ("4:4", (4, 4))])
def test_parse_steps(text, bounds):
    assert parse_steps(text) == bounds


@pytest.mark.parametrize("text", ["7", "7:3", "a:b", ":5"])
def test_parse_steps_refuses(text):
    with pytest.raises(UserError, match=r"^--steps: .* is not FIRST:LAST"):
        parse_steps(text)


def test_a_folder_without_phases_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(
        UserError,
        match=rf"^{run / 'ranks'}: not found\. a run made by this version of grpo_ds.train",
    ):
        read_timeline(run)
    (run / "ranks").mkdir()
    (run / "ranks" / "rank0.jsonl").write_text(
        json.dumps({"step": 1, "trained_sample_ids": [0]}) + "\n"
    )
    with pytest.raises(
        UserError, match=r'ranks: has no step records with "phases" .*grpo_ds.train writes them'
    ):
        read_timeline(run)


def test_a_continuous_rollout_ranks_running_batch_is_read_with_the_steps_drawn(tmp_path):
    run = write_logs(tmp_path / "run", range(1, 4))
    log = run / "ranks" / "rank2.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:  # each step's record: the running batch since the record before
        if line.get("phases") and line.get("role") == "rollout":
            at = T0 + 10 * line["step"]
            line["running_rows"] = [[at, 16], [at + 0.25, 12], ["bad", 3], [at + 0.5, True]]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    timeline = read_timeline(run, (2, 3))
    assert timeline.lanes[2].running == (
        (T0 + 20, 16),
        (T0 + 20.25, 12),
        (T0 + 30, 16),
        (T0 + 30.25, 12),
    )
    assert timeline.lanes[0].running == ()  # a trainer rank's log has none
