"""Continuous generation under split placement through the real `deepspeed` launcher
(grpo_ds/step/continuous.py, grpo_ds/rollout/hf_continuous.py): 1 trainer rank + 1 rollout rank (and
2 at staleness 0), hf engine, on the CPU.

- exact at staleness 0: the run trains what the colocated run trains (the same samples, every metric
  within 1e-5 over 12 steps) while its running batch (16 rows for a step's 32) refills within each
  step; the same with two rollout ranks, each decoding its 2 groups of a step in 8 rows, the first
  putting the step's batch together from both;
- staleness 1: samples span weight updates (per-token versions, the staleness bound per token);
  a SIGTERM to the trainer stops every rank after a step with a checkpoint (exit 75) while the
  rollout rank has sequences in flight, a SIGKILLed rollout rank ends the job with one line naming
  it, and the same command resumes each time, training every step once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_ds.run.preemption import EXIT_PREEMPTED
from tests.launch import REPO, rank_log_records
from tests.step.test_schedule import (
    ENV,
    HELD,
    REWARDS,
    SPLIT_KEYS,
    _metrics,
    _ok,
    _run,
    _signal_rollout_rank,
    _steady,
    _trainer_log,
)

pytestmark = pytest.mark.slow

# long enough completions (the random tiny model rarely ends before 24 tokens, and sometimes does)
# and a running batch of 2 groups of 8 for a step's 4: the refill has work within every step
CONTINUOUS = [
    "rollout.continuous=true",
    "rollout.max_new_tokens=24",
    "rollout.generation_batch_prompts=2",
]
STEPS = 8
S1 = [
    *SPLIT_KEYS,
    *CONTINUOUS,
    "rollout.max_staleness=1",
    f"train.steps={STEPS}",
    "checkpoint.every_steps=1",
    *HELD,
]
CLOSE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def reward_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "split_rewards.py").write_text(REWARDS)
    ENV["PYTHONPATH"] = f"{folder}:{REPO}"


def _close(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, abs=CLOSE, rel=CLOSE), key
            else:
                assert mine[key] == value, key


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> Path:
    """The colocated run the staleness-0 runs train the same as (one rank)."""
    out = tmp_path_factory.mktemp("colocated")
    _ok(_run(1, out, "train.steps=12", *CONTINUOUS[1:]))
    return out / "tiny_cpu"


# (rollout ranks, running-batch capacity in rows): one rollout rank holds 2 groups of a step's 4;
# two hold 2 groups each, and run 1 at a time, so each rank's batch refills within the step too
LAYOUTS = [(1, 16), (2, 8)]


@pytest.mark.parametrize("rollout_ranks, capacity", LAYOUTS)
def test_continuous_at_staleness_zero_trains_what_colocated_trains(
    tmp_path, colocated, rollout_ranks, capacity
):
    layout = [
        'rollout.placement="split"',
        f"rollout.ranks={rollout_ranks}",
        *CONTINUOUS[:2],
        f"rollout.generation_batch_prompts={capacity // 8}",
    ]
    _ok(_run(1 + rollout_ranks, tmp_path / "split", *layout, "train.steps=12"))
    continuous = tmp_path / "split" / "tiny_cpu"
    got, expected = _metrics(continuous), _metrics(colocated)
    assert sum(m["grad_norm"] > 0 for m in expected) >= 6  # the weights move
    _close(
        [
            {k: v for k, v in m.items() if not k.startswith(("placement/", "rollout/"))}
            for m in _steady(got)
        ],
        _steady(expected),
    )
    # the same samples trained at every step, and the same final weights to float rounding (the
    # sampler's log-probs, in the importance weights, differ from the batch-by-batch engine's by
    # ~1e-7: rows ran beside others)
    trained = [_trainer_log(run, 0) for run in (continuous, colocated)]
    assert [r for r in trained[0] if "final_weights_sha256" not in r] == [
        r for r in trained[1] if "final_weights_sha256" not in r
    ]
    final = [
        load_file(run / "final_model" / "model.safetensors") for run in (continuous, colocated)
    ]
    assert final[0].keys() == final[1].keys()
    for name, tensor in final[1].items():
        torch.testing.assert_close(final[0][name], tensor, atol=CLOSE, rtol=0)
    lengths = {m["response_len_mean"] for m in got}
    assert len(lengths) > 1 and min(lengths) < 24, lengths
    for m in got:
        assert m["placement/staleness_max"] == 0 and m["placement/version_spread_max"] == 0
        assert m["placement/samples_spanning_update_frac"] == 0.0
        # the batch refilled: more than one group of 8 ran at a time on a rank, never more than its
        # capacity (two rollout ranks: one group at a time, a second joining as the first ends)
        low = 8 if rollout_ranks == 1 else 0
        assert low < m["rollout/running_rows_mean"] <= capacity, m["rollout/running_rows_mean"]
        assert m["rollout/tokens_per_s"] > 0
    for rank in range(1, 1 + rollout_ranks):  # every rollout rank decoded its share of every step
        records = rank_log_records(continuous / "ranks" / f"rank{rank}.jsonl")
        assert [(r["step"], r["weight_version"]) for r in records] == [
            (k, k - 1) for k in range(1, 13)
        ]


def _held_launch(out: Path, held_after: int, local_rank: int, signum: int):
    """The staleness-1 continuous run in ``out`` (1 trainer + 1 rollout rank), held and signalled
    as test_schedule's fault tests are (``_signal_rollout_rank``)."""
    return _signal_rollout_rank(out, held_after, signum, 2, local_rank, tuple(S1))


def test_continuous_at_staleness_one_stops_and_resumes_training_every_step_once(tmp_path):
    """Three launches of one run: a SIGTERM to the trainer while the rollout rank, two steps on, is
    held in a step's reward with the next step's sequences admitted; a resume whose rollout rank is
    SIGKILLed while held; a resume to the end."""
    run_dir = tmp_path / "tiny_cpu"
    proc, err, _ = _held_launch(tmp_path, 2, 0, signal.SIGTERM)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = len(_metrics(run_dir))
    assert f"preempted: stopped by SIGTERM after step {stopped} of {STEPS}" in err, err[-3000:]

    proc, err, took = _held_launch(tmp_path, stopped + 2, 1, signal.SIGKILL)
    assert f"resuming after step {stopped}" in err, err[-3000:]
    assert proc.returncode != 0 and took < 15, (proc.returncode, took)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout ranks" in errors[0], err[-3000:]
    killed = len(_metrics(run_dir))
    assert stopped < killed < STEPS

    resumed = _ok(_run(2, tmp_path, *S1))
    assert "resuming after step" in resumed
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # every step once
    assert [m["placement/staleness_max"] for m in metrics][:1] == [0]
    assert all(m["placement/staleness_max"] <= 1 for m in metrics)
    # new weights reached sequences in flight: samples whose tokens span two versions
    assert max(m["placement/samples_spanning_update_frac"] for m in metrics) > 0
    assert max(m["placement/version_spread_max"] for m in metrics) == 1
    assert all(m["grad_norm"] > 0 for m in metrics)
