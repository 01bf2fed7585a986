"""benchmarks/bench_placement.py's pure parts on made-up metrics files: the steady-state cut, the
table's figures (median step, samples/s, each side's idle fraction), the targets, the placement
model's --measured file, and the block as the benchmarks page reads it. No launch."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    yield _load("bench_placement", ROOT / "benchmarks" / "bench_placement.py")
    sys.modules.pop("bench_placement", None)


@pytest.fixture(scope="module")
def sim():
    yield _load("simulate_placement", ROOT / "benchmarks" / "simulate_placement.py")
    sys.modules.pop("simulate_placement", None)


N = 8  # samples a step
# Phases chosen so that the placement model reproduces every step exactly: colocated, each rank
# decodes 4 samples at 0.25 s a token step (2 steps) and trains 4; split, the rollout rank decodes 8
# at 0.45 s, the trainer trains 8.
COLOCATED = {
    "time_rollout_s": 0.5,
    "time_reward_s": 0.1,
    "time_logprob_s": 0.2,
    "time_update_s": 0.6,
    "time_sync_s": 0.05,
}
# split: generate + reward, logprob + update, the broadcast
GEN, TRAIN, SYNC = 0.9 + 0.1, 0.4 + 1.2, 0.05


def _split_step(step: int, staleness: int, trainer_idle: float | None = None) -> dict:
    wall = GEN + TRAIN + SYNC if staleness == 0 else max(GEN, TRAIN) + SYNC
    idle = (GEN if staleness == 0 else 0.0) if trainer_idle is None else trainer_idle
    return {
        "step": step,
        "time_step_s": wall,
        "time_wait_s": idle,
        "time_logprob_s": 0.4,
        "time_update_s": 1.2,
        "time_sync_s": SYNC,
        "placement/trainer_idle_s": idle,
        "placement/trainer_busy_s": wall - idle,
        "placement/rollout_busy_s": GEN,
        "placement/rollout_idle_s": wall - GEN,
        "rollout_side/time_rollout_s": 0.9,
        "rollout_side/time_reward_s": 0.1,
        "placement/staleness_max": staleness,
        "response_len_mean": 2.0,
    }


def _with_startup(steps: list[dict]) -> list[dict]:
    """Two slow first steps (start-up, the pipeline's fill) the cut must drop."""
    for m in steps[:2]:
        m["time_step_s"], m["placement/trainer_idle_s"] = 30.0, 29.0
        m["time_rollout_s"] = m["rollout_side/time_rollout_s"] = 25.0
    return steps


def _colocated() -> list[dict]:
    step = sum(COLOCATED.values())
    return _with_startup(
        [
            {"step": s, "time_step_s": step, **COLOCATED, "response_len_mean": 2.0}
            for s in range(1, 9)
        ]
    )


def _runs(bench, tmp_path, s1_trainer_idle: float | None = None):
    files = {
        "colocated": _colocated(),
        "s0": _with_startup([_split_step(s, 0) for s in range(1, 9)]),
        "s1": _with_startup([_split_step(s, 1, s1_trainer_idle) for s in range(1, 9)]),
    }
    for name, steps in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    read = lambda name: bench.read_metrics(tmp_path / f"{name}.jsonl")  # noqa: E731
    return [
        bench.summarize(read("colocated"), "colocated", 0, 0, N, skip=2),
        bench.summarize(read("s0"), "split", 1, 0, N, skip=2),
        bench.summarize(read("s1"), "split", 1, 1, N, skip=2),
    ]


def test_the_steady_state_cut_drops_the_first_steps(bench):
    steps = [{"step": s} for s in range(1, 6)]
    assert [m["step"] for m in bench.steady(steps, 2)] == [3, 4, 5]
    assert bench.steady(steps, 0) == steps
    with pytest.raises(ValueError, match="no steady step"):
        bench.steady(steps, 5)


def test_the_table_reads_step_samples_and_idle_from_the_steady_steps(bench, tmp_path):
    colocated, s0, s1 = _runs(bench, tmp_path)
    assert (colocated.steps, s0.steps, s1.steps) == (6, 6, 6)  # the 30 s start-up steps are gone
    assert colocated.step_s == pytest.approx(1.45) and colocated.samples_per_s == pytest.approx(
        N / 1.45
    )
    # colocated: the ranks idle as the trainer while they generate and score, as the engine while
    # they train
    assert colocated.trainer_idle == pytest.approx(
        0.6 / 1.45
    ) and colocated.rollout_idle == pytest.approx(0.85 / 1.45)
    assert s0.step_s == pytest.approx(2.65) and s0.trainer_idle == pytest.approx(1.0 / 2.65)
    assert s0.rollout_idle == pytest.approx(1.65 / 2.65) and s0.rollout_busy_s == pytest.approx(1.0)
    assert s1.step_s == pytest.approx(1.65) and s1.trainer_idle == 0.0
    assert s1.rollout_idle == pytest.approx(0.65 / 1.65) and s1.staleness_max == 1
    assert s0.phases == pytest.approx(
        {"rollout": 0.9, "reward": 0.1, "logprob": 0.4, "update": 1.2, "sync": 0.05}
    )
    table = bench.table([colocated, s0, s1])
    assert "| split     | 1 | 1 | 1.650           | 5         | 0.0%         | 39.4%" in table


def test_the_wall_step_is_rank_0s_step_end_to_step_end_from_the_cut_on(bench):
    """Steps end at 10, 20 (slow start-up), 21.5, 23, 24.5: from step 2 on, 1.5 s a step, the gaps
    between the steps' spans (metrics, logging) counted; records without a step or spans are
    skipped."""
    ends = {1: 10.0, 2: 20.0, 3: 21.5, 4: 23.0, 5: 24.5}
    log = [
        {"step": k, "phases": [["wait", e - 1.2, e - 1.0], ["update", e - 1.0, e]]}
        for k, e in ends.items()
    ]
    log.append({"step": None, "phases": []})
    assert bench.wall_per_step(log, 2) == pytest.approx(1.5)
    assert bench.wall_per_step(log, 5) is None


def test_the_targets(bench, tmp_path):
    ratio, idle, ratio_ok, idle_ok = bench.targets(_runs(bench, tmp_path))
    assert ratio == pytest.approx(1.65 / 2.65) and ratio_ok and idle == 0.0 and idle_ok
    # the trainer waits 0.5 s of a 1.65 s step at S = 1: 30% idle, beyond 15%
    ratio, idle, ratio_ok, idle_ok = bench.targets(_runs(bench, tmp_path, s1_trainer_idle=0.5))
    assert ratio_ok and idle == pytest.approx(0.5 / 1.65) and not idle_ok
    notes = bench.target_notes(_runs(bench, tmp_path, s1_trainer_idle=0.5))
    assert notes[0].endswith("target (split S=1 step <= 0.65 x split S=0's): met")
    assert notes[1] == "trainer idle at S=1: 30.3%; target (trainer idle at S=1 <= 15%): NOT met"
    assert notes[2] == (
        "colocated beside them: step 1.450 s; split S=0 / colocated step 1.828, split S=1 / "
        "colocated step 1.138"
    )
    assert len(notes) == 3  # no wall s a step from rank logs here
    walls = [
        bench.dataclasses.replace(r, wall_step_s=r.mean_step_s + 0.1)
        for r in _runs(bench, tmp_path)
    ]
    assert bench.target_notes(walls)[3] == (
        "by rank 0's wall s a step instead of time_step_s: split S=1 / split "
        "S=0 0.636; wall s a step minus the mean time_step_s (what rank 0 does "
        "between steps): colocated 0.100 s, S=0 0.100 s, S=1 0.100 s"
    )


def test_the_measured_file_is_the_models_format_and_the_derived_inputs_reproduce_the_runs(
    bench, sim, tmp_path
):
    runs = _runs(bench, tmp_path)
    inputs = bench.model_inputs(runs, token_steps=2, mean_new_tokens=2.0)
    assert [b for b, _ in inputs["t_token"]] == [4, 8]
    assert [s for _, s in inputs["t_token"]] == pytest.approx([0.25, 0.45])
    assert inputs["train_efficiency"] == pytest.approx(1.0)
    measured = bench.measured_file(runs, inputs, "a machine", "abc1234")
    assert [(r["placement"], r["rollout_ranks"], r["staleness"]) for r in measured["runs"]] == [
        ("colocated", 0, 0),
        ("split", 1, 0),
        ("split", 1, 1),
    ]
    text, ok = sim.compare(measured["inputs"], json.loads(json.dumps(measured)))
    assert ok and text.count("+0.0%") == 3
    # half the samples stop after one token: the decode costs sit at the batch a decode step sees on
    # average, where the model reads them, so the model still reproduces the runs
    inputs = bench.model_inputs(runs, token_steps=2, mean_new_tokens=1.0)
    assert [b for b, _ in inputs["t_token"]] == [2, 4]
    text, ok = sim.compare(inputs, bench.measured_file(runs, inputs, "a machine", "abc1234"))
    assert ok and text.count("+0.0%") == 3


def test_the_benchmarks_page_reads_the_block(bench, tmp_path):
    generate = _load("docs_generate_bench_placement", ROOT / "docs" / "generate.py")
    runs = _runs(bench, tmp_path, s1_trainer_idle=0.5)
    block = "\n".join(
        [
            "## bench_placement: colocated vs split S=0 vs S=1, x, cpu (2026-11-27 08:00 UTC)",
            "",
            "- machine: m",
            "- command: `c`",
            "- commit: abc1234",
            "",
            bench.table(runs),
            "",
            *[f"- {n}" for n in bench.target_notes(runs)],
            "",
        ]
    )
    learns = (
        "## bench_placement: learns, tiny_vllm_cpu.json split K=1 S=1, seeds 0 (2026-11-27 08:10 "
        "UTC)\n\n"
        "- machine: m\n- command: `c`\n- commit: abc1234\n\n"
        "| seed | reward, last 10 steps | training s | staleness max |\n|---|---|---|---|\n"
        "| 0 | 0.950 | 400.0 | 1 |\n\n- target (every seed's last-10 reward >= 0.9): met\n"
    )
    _, found = generate.blocks("# Benchmark results\n\npreamble\n\n" + block + "\n" + learns)
    rows = {row.question.title: row for row in generate.summary(found)[0]}
    row = rows["Placement: colocated vs split S=0 vs S=1 (CPU, real vLLM)"]
    # the learns block, later, answers another row
    assert row.block.index == 1 and row.unreadable is None
    assert (
        row.figure
        == "step s: split S=1 1.650, split S=0 2.650, colocated 1.450; trainer idle at S=1 30.3%"
    )
    assert [(t.what, t.met) for t in row.targets] == [
        ("split S=1 step <= 0.65 x split S=0's", True),
        ("trainer idle at S=1 <= 15%", False),
    ]
    assert rows["Split placement learns (tiny_vllm_cpu.json, S=1)"].figure.startswith(
        "last-10 reward 0.950-0.950"
    )
