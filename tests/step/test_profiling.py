"""Profiling (grpo_ds/step/profiling.py): phases timed and labelled, traces of exactly the chosen
steps, one per rank, and the recipe keys' errors."""

import json
import time

import pytest
import torch

from grpo_ds.config.loading import load_recipe
from grpo_ds.config.recipe import LoggingConfig
from grpo_ds.distributed.ranks import Dist
from grpo_ds.errors import UserError
from grpo_ds.step.profiling import Phase, comms_path, profiled_steps, trace_path
from tests.launch import REPO, deepspeed_launch

PHASES = ("rollout", "reward", "logprob", "advantage", "update", "sync")
ONE_RANK = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _labels(path) -> list[str]:
    """The user annotations (record_function labels) of a Chrome-trace JSON file, in order."""
    events = json.loads(path.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "user_annotation"]


def test_phase_adds_its_time_and_labels_the_block():
    times = {"rollout": 1.0}
    with torch.profiler.profile() as prof:
        for _ in range(2):  # a phase that runs twice in a step (dynamic sampling's rounds) adds up
            with Phase("rollout", times):
                time.sleep(0.01)
        with Phase("eval") as phase:  # no times dict: label only, the time on the object
            torch.ones(3).sum()
    assert times["rollout"] >= 1.02 and set(times) == {"rollout"}
    assert phase.seconds > 0
    names = [e.name for e in prof.events()]
    assert names.count("grpo/rollout") == 2 and "grpo/eval" in names


def _run_loop(steps: range, profile_steps, run_dir) -> list[int]:
    cfg = LoggingConfig(profile_steps=profile_steps)
    seen = []
    for step in profiled_steps(steps, cfg, run_dir, ONE_RANK):
        with Phase("update"):
            torch.randn(8, 8) @ torch.randn(8, 8)
        seen.append(step)
    return seen


def test_trace_holds_exactly_the_chosen_steps(tmp_path):
    assert _run_loop(range(1, 6), [3, 4], tmp_path) == [1, 2, 3, 4, 5]
    labels = _labels(trace_path(tmp_path, 0))
    # 2: warm-up only
    assert [n for n in labels if n.startswith("grpo/step")] == ["grpo/step 3", "grpo/step 4"]
    assert labels.count("grpo/update") == 2


def test_a_resumed_run_traces_the_rest_of_the_range_and_off_writes_nothing(tmp_path):
    # resumed after step 3: step 4 is left, no warm-up step
    _run_loop(range(4, 6), [3, 4], tmp_path / "resumed")
    assert [
        n for n in _labels(trace_path(tmp_path / "resumed", 0)) if n.startswith("grpo/step")
    ] == ["grpo/step 4"]
    _run_loop(range(5, 7), [3, 4], tmp_path / "past")  # resumed past the range
    _run_loop(range(1, 3), None, tmp_path / "off")
    assert not (tmp_path / "past").exists() and not (tmp_path / "off").exists()


@pytest.mark.slow
def test_two_ranks_write_a_trace_each_with_the_phases_and_the_collectives(tmp_path):
    """The docs' example (docs/guides/evaluation-and-metrics.md) at world size 2 through the real
    launcher: step 2 of 2 traced (step 1 warms up)."""
    deepspeed_launch(
        2,
        [
            "--module",
            "grpo_ds.train",
            str(REPO / "recipes" / "tiny_cpu.json"),
            f"run.output_dir={tmp_path}",
            "train.steps=2",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "train.micro_batch_samples_per_gpu=2",
            "logging.progress_bar=false",
            "logging.profile_steps=[2, 2]",
            "logging.profile_comms=true",
        ],
    )
    run_dir = tmp_path / "tiny_cpu"
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [
        "rank0.comms.txt",
        "rank0.memory.csv",
        "rank0.pt.trace.json",
        "rank1.comms.txt",
        "rank1.memory.csv",
        "rank1.pt.trace.json",
    ]
    for rank in range(2):
        labels = _labels(trace_path(run_dir, rank))
        assert [n for n in labels if n.startswith("grpo/step")] == ["grpo/step 2"]
        assert all(labels.count(f"grpo/{p}") == 1 for p in PHASES), labels
        assert "gloo:all_reduce" in labels  # torch.distributed's collectives are in the trace too
        comms = comms_path(run_dir, rank).read_text()
        # ZeRO-3's gathers, reduces
        assert "all_gather_into_tensor" in comms and "reduce_scatter_tensor" in comms
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(
        {f"time_{p}_s" for p in ("rollout", "reward", "logprob", "update", "sync")} <= m.keys()
        for m in metrics
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"logging.profile_steps": [2]},
            "logging.profile_steps: [2] is not [first, last], two step numbers. e.g. [2, 3].",
        ),
        (
            {"logging.profile_steps": [2.0, 3]},
            "logging.profile_steps: [2.0, 3] is not [first, last], two step numbers. e.g. [2, 3].",
        ),
        (
            {"logging.profile_steps": [0, 3]},
            "logging.profile_steps: [0, 3] must have 1 <= first <= last (steps count "
            "from 1). e.g. [1, 3].",
        ),
        (
            {"logging.profile_steps": [5, 2]},
            "logging.profile_steps: [5, 2] must have 1 <= first <= last (steps count "
            "from 1). e.g. [2, 5].",
        ),
        (
            {"logging.profile_steps": [4, 12]},
            "logging.profile_steps: [4, 12] ends after the run's last step "
            "(train.steps 10). e.g. [4, 5].",
        ),
        (
            {"logging.profile_steps": [11, 12]},
            "logging.profile_steps: [11, 12] ends after the run's last step "
            "(train.steps 10). e.g. [2, 3].",
        ),
        (
            {"logging.profile_steps": [1, 11], "train.steps": 20},
            "logging.profile_steps: [1, 11] is 11 steps; at most "
            "10 with logging.profile_trace (a trace holds every "
            "operator of every step it covers). e.g. [1, 2]: a few "
            "steps show where the time goes, or logging."
            "profile_trace=false for the memory timeline alone "
            "over any range.",
        ),
        (
            {"logging.profile_comms": True},
            "logging.profile_comms: logs the profiled steps, but logging.profile_steps "
            "is null. set logging.profile_steps too, e.g. [2, 3].",
        ),
        (
            {"logging.memory_sample_ms": 0},
            "logging.memory_sample_ms: 0 is out of range: must be >= 1. e.g. 10.",
        ),
    ],
)
def test_bad_profiling_keys_are_one_clear_line(overrides, message):
    with pytest.raises(UserError) as info:
        load_recipe({"train": {"steps": 10}}, overrides)
    assert str(info.value) == message and "\n" not in message


def test_profiling_keys_load():
    r = load_recipe(
        {},
        {
            "train.steps": 3,
            "logging.profile_steps": [3, 3],
            "logging.profile_comms": True,
            "logging.profile_trace": False,
            "logging.memory_sample_ms": 2,
        },
    )
    assert (r.logging.profile_steps, r.logging.profile_comms, r.logging.profile_trace) == (
        [3, 3],
        True,
        False,
    )
    assert r.logging.memory_sample_ms == 2
    timeline_only = load_recipe(
        {}, {"train.steps": 500, "logging.profile_steps": [2, 500], "logging.profile_trace": False}
    ).logging
    assert timeline_only.profile_steps == [2, 500]  # no trace, so no 10-step cap
    default = load_recipe({}).logging
    assert (default.profile_steps, default.profile_trace, default.memory_sample_ms) == (
        None,
        True,
        10,
    )
