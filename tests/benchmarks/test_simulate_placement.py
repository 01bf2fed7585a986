"""benchmarks/simulate_placement.py: the placement model's formulas on hand-computed cases, the
decode curve, and the --measured check's exit code on made-up measurement files."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_placement.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("simulate_placement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


# 8 samples, 10 decode steps; a decode step costs 0.1 s up to 4 sequences, then rises linearly to
# 0.2 s at 8.
INPUTS = {
    "samples_per_step": 8,
    "token_steps": 10,
    "t_token": [[1, 0.1], [4, 0.1], [8, 0.2]],
    "generate_overhead_s": 0.5,
    "train_s_per_sample": 1.0,
    "logprob_s_per_sample": 0.25,
    "reward_s": 0.3,
    "sync_s": 0.2,
    "split_sync_s": 0.4,
}


def test_colocated_is_the_sum_of_every_phase_on_all_ranks(sim):
    p = sim.predict(INPUTS, "colocated", world=2)
    # each rank decodes 4 samples at 0.1 s a step: 0.5 + 10 x 0.1 = 1.5; train 8 x 1.0 / 2 = 4;
    # logprob 8 x 0.25 / 2 = 1
    assert p.phases == pytest.approx(
        {"rollout": 1.5, "reward": 0.3, "logprob": 1.0, "update": 4.0, "sync": 0.2}
    )
    assert p.step_s == pytest.approx(1.5 + 0.3 + 1.0 + 4.0 + 0.2)
    assert p.samples_per_s == pytest.approx(8 / 7.0)
    assert (p.trainer_idle, p.rollout_idle) == pytest.approx((1.8 / 7.0, 5.0 / 7.0))


def test_split_at_staleness_0_is_the_sum_of_the_two_sides_and_the_transfer(sim):
    p = sim.predict(INPUTS, "split", world=3, rollout_ranks=1, staleness=0)
    # G: 8 samples on one rank at 0.2 s a step: 0.5 + 2.0, + reward 0.3 = 2.8; T on 2 ranks: 4 + 1 =
    # 5; X = 0.4
    assert p.phases["rollout"] == pytest.approx(2.5)
    assert p.step_s == pytest.approx(2.8 + 5.0 + 0.4)
    assert (p.trainer_idle, p.rollout_idle) == pytest.approx((2.8 / 8.2, 5.0 / 8.2))


@pytest.mark.parametrize("staleness", [1, 2])
def test_split_ahead_is_the_slower_side_plus_the_whole_transfer(sim, staleness):
    p = sim.predict(INPUTS, "split", world=3, rollout_ranks=1, staleness=staleness)
    # the trainer is the slower side; S >= 1 all alike
    assert p.step_s == pytest.approx(max(2.8, 5.0) + 0.4)
    assert (p.trainer_idle, p.rollout_idle) == pytest.approx((0.0, 2.2 / 5.4))
    fast_trainer = sim.predict(
        {**INPUTS, "train_s_per_sample": 0.1, "logprob_s_per_sample": 0.0}, "split", 3, 1, 1
    )
    assert fast_trainer.step_s == pytest.approx(2.8 + 0.4)  # T = 8 x 0.1 / 2 = 0.4 waits for G
    assert (fast_trainer.trainer_idle, fast_trainer.rollout_idle) == pytest.approx((2.4 / 3.2, 0.0))


def test_the_reward_counts_on_the_side_that_scores(sim):
    on_trainer = sim.predict({**INPUTS, "reward_side": "trainer"}, "split", 3, 1, 1)
    assert on_trainer.step_s == pytest.approx(max(2.5, 5.3) + 0.4)


def test_more_rollout_ranks_lower_generation_along_the_decode_curve(sim):
    gen = {k: sim.predict(INPUTS, "split", 5, k, 1).phases["rollout"] for k in (1, 2, 4)}
    # flat below 4: no gain
    assert gen == pytest.approx({1: 0.5 + 10 * 0.2, 2: 0.5 + 10 * 0.1, 4: 0.5 + 10 * 0.1})
    # linear, like a CPU
    cpu = {**INPUTS, "t_token": [[1, 0.01], [8, 0.08]], "generate_overhead_s": 0.0}
    gen = {k: sim.predict(cpu, "split", 5, k, 1).phases["rollout"] for k in (1, 2, 4)}
    assert gen == pytest.approx({1: 0.8, 2: 0.4, 4: 0.2})
    # the last segment, extended
    assert sim.t_token(sim.check_inputs(cpu)["t_token"], 16) == pytest.approx(0.16)
    # half the samples stop at 5 of 10 steps: a step sees 4 sequences on average
    half = sim.predict({**cpu, "mean_new_tokens": 5}, "split", 5, 1, 1)
    assert half.phases["rollout"] == pytest.approx(10 * 0.04)


def test_bad_inputs_name_the_key(sim):
    with pytest.raises(ValueError, match="'train_s_per_sample' is required"):
        sim.predict({k: v for k, v in INPUTS.items() if k != "train_s_per_sample"}, "colocated", 2)
    with pytest.raises(ValueError, match="unknown key 'sync'"):
        sim.predict({**INPUTS, "sync": 1.0}, "colocated", 2)
    with pytest.raises(ValueError, match="no split layout"):
        sim.predict(INPUTS, "split", 2, rollout_ranks=2)
    with pytest.raises(ValueError, match="reward_s is -1"):
        sim.predict({**INPUTS, "reward_s": -1}, "colocated", 2)
    with pytest.raises(ValueError, match="mean_new_tokens 11 is more than token_steps"):
        sim.predict({**INPUTS, "mean_new_tokens": 11}, "colocated", 2)
    with pytest.raises(ValueError, match="one point a batch"):
        sim.predict({**INPUTS, "t_token": [[4, 0.1], [4, 0.2]]}, "colocated", 2)


def _measured(tmp_path, scale: float, with_inputs: bool) -> Path:
    runs = [
        {
            "placement": "colocated",
            "world": 2,
            "rollout_ranks": 0,
            "staleness": 0,
            "step_s": 7.0 * scale,
            "phases": {"rollout": 1.5, "update": 4.0},
        },
        {"placement": "split", "world": 3, "rollout_ranks": 1, "staleness": 0, "step_s": 8.2},
        {
            "placement": "split",
            "world": 3,
            "rollout_ranks": 1,
            "staleness": 1,
            "step_s": 5.4,
            "samples_per_step": 8,
        },
    ]
    path = tmp_path / "measured.json"
    path.write_text(
        json.dumps(
            {"machine": "made up", "runs": runs, **({"inputs": INPUTS} if with_inputs else {})}
        )
    )
    return path


def test_measured_rows_within_15_percent_pass_and_one_beyond_fails(sim, tmp_path, capsys):
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps(INPUTS))
    assert (
        sim.main(["--inputs", str(inputs), "--measured", str(_measured(tmp_path, 1.14, False))])
        == 0
    )
    assert "-12.3%" in capsys.readouterr().out  # 7.0 predicted against 7.98 measured
    # +17.6%: the inputs from the file
    assert sim.main(["--measured", str(_measured(tmp_path, 0.85, True))]) == 1
    out = capsys.readouterr().out
    assert "+17.6%" in out and "OFF" in out and "rollout 1.5/1.5" in out
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--measured", str(_measured(tmp_path, 1.3, True))],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stdout + done.stderr


def test_the_command_line_table_and_its_errors(sim, tmp_path, capsys):
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps(INPUTS))
    assert (
        sim.main(
            ["--inputs", str(inputs), "--world", "3", "--rollout-ranks", "1", "--staleness", "1"]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:4] for line in lines[1:]] == [
        ["colocated", "3", "0", "0"],
        ["split", "3", "1", "0"],
        ["split", "3", "1", "1"],
    ]
    assert lines[3].split()[4] == "5.4"
    inputs.write_text(json.dumps({**INPUTS, "t_token": []}))
    assert sim.main(["--inputs", str(inputs)]) == 2
    assert "t_token" in capsys.readouterr().err


def test_published_marks_every_input_and_shows_the_published_figures(sim):
    assert all(
        src == "assumed" or src.startswith("measured (") for _, _, src, _ in sim.PUBLISHED_INPUTS
    )
    text = sim.published()
    assert "92.8" in text and "64.8" in text and "1581" in text and "2478" in text


# ---- long tails and continuous generation (issue 52)


def test_a_generate_call_runs_as_long_as_its_expected_longest_sample(sim):
    # lengths 1, 2, 3, 4 equally likely: the longest of 2 draws is x with F(x)^2 - F(x-1)^2
    given = {**INPUTS, "lengths": [4, 1, 3, 2]}
    assert sim.longest(sim.check_inputs(given), 2) == pytest.approx(
        1 * 1 / 16 + 2 * 3 / 16 + 3 * 5 / 16 + 4 * 7 / 16
    )
    assert sim.longest(sim.check_inputs({**INPUTS, "longest_new_tokens": 6}), 8) == 6
    assert sim.longest(sim.check_inputs(INPUTS), 8) == 10  # token_steps
    # batch by batch on one rank, lengths 2 (7 in 8) or 10: the longest of 8 draws is 10 unless all
    # are 2, ~7.25 decode steps on average, at 8 x 3 / 7.25 = 3.3 sequences (0.1 s a step)
    tail = {**INPUTS, "lengths": [2] * 7 + [10]}
    expected = 2 * (7 / 8) ** 8 + 10 * (1 - (7 / 8) ** 8)
    assert sim.longest(sim.check_inputs(tail), 8) == pytest.approx(expected)
    p = sim.predict(tail, "split", 2, 1, 0)
    assert p.phases["rollout"] == pytest.approx(0.5 + expected * 0.1)


def test_continuous_generation_is_simulated_step_by_step(sim):
    # one rollout rank, 8 rows a step of 8 tokens each, a decode step 0.125 s at any batch, scoring
    # 0.25 s; two trainer ranks: T = 8 x 0.0625 / 2 = 0.25 and X = 0.25
    given = {
        **INPUTS,
        "lengths": [8],
        "t_token": [[1, 0.125]],
        "train_s_per_sample": 0.0625,
        "logprob_s_per_sample": 0.0,
        "reward_s": 0.25,
        "split_sync_s": 0.25,
    }
    p = sim.predict(given, "split", 3, 1, 1, continuous=True)
    # S = 1: steps 1 and 2 run together and end at 1.0 (scored 1.25, 1.5); the trainer's v_1 comes
    # at 1.75, step 3 starts then; v_2 at 2.25, step 4 joins step 3 halfway (4 of its 8 tokens).
    # Step 3 ends at 2.75 (scored 3.0), step 4 at 3.5 (scored 3.75), the trainer's v_3 at 3.5 and
    # v_4 at 4.25: from then on two steps each 2.0 s, 1.0 s a step (where the formula of S + 1
    # steps sharing latency + reward + T + X would say 0.875: the two scorings are both in the way)
    assert p.step_s == pytest.approx(1.0)
    assert p.rollout_idle == pytest.approx(0.0)
    assert p.trainer_idle == pytest.approx(0.5)  # it waits 0.5 s of each 1.0 for a batch
    # a slow trainer is the floor: T = 8 x 1.25 / 2 = 5, + X
    slow = {**given, "train_s_per_sample": 1.0, "logprob_s_per_sample": 0.25}
    assert sim.predict(slow, "split", 3, 1, 1, continuous=True).step_s == pytest.approx(5.25)
    # at S = 0 continuous is batch by batch
    assert (
        sim.predict(given, "split", 3, 1, 0, continuous=True).step_s
        == sim.predict(given, "split", 3, 1, 0).step_s
    )
    with pytest.raises(ValueError, match="needs lengths"):
        sim.predict(INPUTS, "split", 3, 1, 1, continuous=True)


def test_lengths_must_be_sample_lengths_within_the_limit(sim):
    for bad in ([], [0], [11], "long"):
        with pytest.raises(ValueError, match="lengths"):
            sim.check_inputs({**INPUTS, "lengths": bad})


def test_the_long_tail_table_states_its_assumptions_and_the_anchors(sim):
    text = sim.long_tail()
    assert "assumed (no input measured or fitted)" in text and "UniRL#94" in text
    assert sum(line.startswith(("0.5B", "1.5B", "7B")) for line in text.splitlines()) == 9
