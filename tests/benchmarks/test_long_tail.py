"""benchmarks/long_tail.py's pure parts on made-up metrics: a run's summary (a batch-by-batch run's
decode steps are its longest completion, a continuous run's its tokens over its running batch, each
with its own cost of a decode step), the verdicts, and the placement model's file. No launch."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tail():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("long_tail", ROOT / "benchmarks" / "long_tail.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(ROOT / "benchmarks"))


# a decode step costs 0.002 s + 0.0001 s a row
A, S = 0.002, 0.0001


def _steps(continuous: bool, rewards: list[float], n: int) -> list[dict]:
    """A run's metrics: ``n`` samples a step of 30 tokens on average, the longest 120."""
    mean, longest = 30.0, 120
    tokens = mean * n
    decode_steps = tokens / 100 if continuous else longest
    return [
        {
            "step": k + 1,
            "time_step_s": 0.5 if continuous else 0.8,
            "rollout_side/time_rollout_s": decode_steps * A + S * tokens,
            "rollout_side/time_reward_s": 0.01,
            "time_update_s": 0.2,
            "time_logprob_s": 0.05,
            "time_sync_s": 0.02,
            "response_len_mean": mean,
            "response_len_max": longest,
            "reward_mean": r,
            **(
                {
                    "rollout/running_rows_mean": 100.0,
                    "rollout/tokens_per_s": tokens / (decode_steps * A + S * tokens),
                    "placement/samples_spanning_update_frac": 0.3,
                }
                if continuous
                else {}
            ),
            "placement/staleness_mean": 0.8,
        }
        for k, r in enumerate(rewards)
    ]


def test_each_run_is_summarized_and_measured_with_its_own_decode_cost(tail):
    n = tail.SAMPLES
    batch = tail.summarize(_steps(False, [0.5, 0.6] * 10, n), skip=2)
    flowing = tail.summarize(_steps(True, [0.55, 0.6] * 10, n), skip=2)
    # n samples of 30 tokens: batch by batch 120 decode steps of n x 30 / 120 rows on average,
    # continuous n x 30 / 100 decode steps of 100
    assert batch["decode_steps"] == 120 and batch["running_rows"] == pytest.approx(n / 4)
    assert flowing["decode_steps"] == pytest.approx(n * 0.3) and flowing["running_rows"] == 100
    assert batch["reward_last10"] == pytest.approx(0.55) and batch["step_s"] == 0.8
    results = {("hf", c, s): flowing if c else batch for s in (1, 2) for c in (False, True)}
    file = tail.measured("hf", results, "m", "c")
    costs = [run["inputs"]["t_token"][0][1] for run in file["runs"]]
    # a decode step: 0.002 s + 0.0001 s a row, at each run's own mean rows
    assert costs == pytest.approx([A + S * n / 4, A + S * 100] * 2)
    assert [(r["continuous"], r["staleness"]) for r in file["runs"]] == [
        (False, 1),
        (True, 1),
        (False, 2),
        (True, 2),
    ]


def test_a_continuous_run_s_decode_cost_is_fitted_over_its_batches(tail):
    # batches at 4 to 40 rows of 50 decode steps each, a decode step 0.002 s + 0.0001 s a row: the
    # fit finds both; every batch at one running batch cannot tell them apart
    batches = [
        {
            "rollout_side/time_rollout_s": 50 * (A + S * rows),
            "rollout/running_rows_mean": float(rows),
            "rollout/tokens_per_s": 50 * rows / (50 * (A + S * rows)),
        }
        for rows in (4, 10, 25, 40)
    ]
    assert tail.decode_cost(batches) == pytest.approx((A, S))
    assert tail.decode_cost([batches[0]] * 4) is None
    # the lengths: a geometric tail with the measured mean, cut at the limit
    lengths = tail.geometric_lengths(30.0, 128, count=4000)
    assert sum(lengths) / len(lengths) == pytest.approx(30.0, rel=0.02)
    assert max(lengths) == 128 and min(lengths) == 1


def test_the_verdicts_read_the_step_ratio_and_the_learning_within_noise(tail):
    def run(continuous: bool, rewards: list[float]) -> dict:
        return tail.summarize(_steps(continuous, rewards, tail.SAMPLES), 2)

    same, better = [0.5, 0.6] * 10, [0.9, 0.95] * 10
    results = {
        **{("hf", c, s): run(c, same) for c in (False, True) for s in (1, 2)},
        **{("vllm", c, s): run(c, better if c else same) for c in (False, True) for s in (1, 2)},
    }
    verdicts = tail.verdicts(results)
    # hf: 0.5 / 0.8 = 0.625 <= 0.8, the same rewards; vllm: a reward 0.375 higher is beyond noise;
    # S = 2: a ratio, no verdict
    assert [ok for _, ok in verdicts] == [True, True, None, True, False, None]
    assert "0.625" in verdicts[0][0] and "lower is faster" in verdicts[0][0]
    assert verdicts[2][0] == "hf, S=2: continuous / batch-by-batch step 0.625"
