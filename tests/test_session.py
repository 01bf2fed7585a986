"""grpo_ds/session.py: a rank's parts close in reverse order of opening on every exit path.

Each case runs the tiny recipe for real (one rank, two steps) and records the calls that close its
parts: the rollout engine (opened after the logger), the metrics logger, the reward workers and the
run lock (opened first). A phase is made to end the run in step 1 in each way a run can end: the
last step, a stop signal (preemption), a UserError and a KeyboardInterrupt.
"""

import shutil
import subprocess

import pytest

import grpo_ds
import grpo_ds.train as train_module
from benchmarks.refusals import WORKER_ONLY_FAILS
from grpo_ds.distributed.launcher import EXITS_VAR, recorded_exits
from grpo_ds.errors import UserError
from grpo_ds.rewards.pool import RewardPool
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.run.lock import RunLock
from grpo_ds.run.metrics import MetricsLogger
from grpo_ds.run.preemption import Preempted, StopRequest
from tests.launch import REPO, clean_env, free_port, launch_command, remove_shm_buffers

TINY = "recipes/tiny_cpu.json"
CLOSED_IN_ORDER = ["rollout engine", "logger", "reward workers", "run lock"]


@pytest.fixture
def closes(monkeypatch):
    """The names of the parts closed, in the order their close ran."""
    calls = []
    for owner, method, name in (
        (HFRolloutEngine, "close", "rollout engine"),
        (MetricsLogger, "close", "logger"),
        (RewardPool, "close", "reward workers"),
        (RunLock, "release", "run lock"),
    ):
        real = getattr(owner, method)

        def recording(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(owner, method, recording)
    return calls


def _overrides(tmp_path):
    return {
        "run.output_dir": str(tmp_path / "runs"),
        "train.steps": 2,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 4,
        "logging.progress_bar": False,
        "reward.processes": 1,
    }


def _last_closes(calls: list[str]) -> list[str]:
    """The session's closing sequence: the last call of each part, in order (a preempted run closes
    its logger once before the session does)."""
    last = {name: i for i, name in enumerate(calls)}
    return sorted(last, key=last.get)


def _fail_in_the_update(monkeypatch, error: BaseException) -> None:
    def failing(engine, data, minibatch, settings, dist):
        raise error

    monkeypatch.setattr(train_module, "optimizer_step", failing)


def test_a_finished_run_closes_its_parts_in_reverse(tmp_path, closes):
    grpo_ds.train(TINY, _overrides(tmp_path))
    assert _last_closes(closes) == CLOSED_IN_ORDER


def test_a_preempted_run_closes_its_parts_in_reverse(tmp_path, closes, monkeypatch):
    monkeypatch.setattr(StopRequest, "agreed", lambda self, dist: "SIGTERM")
    with pytest.raises(Preempted):
        grpo_ds.train(TINY, _overrides(tmp_path))
    assert _last_closes(closes) == CLOSED_IN_ORDER


@pytest.mark.parametrize(
    "error",
    [UserError("train.lr", "a planted failure"), KeyboardInterrupt()],
    ids=["user-error", "keyboard-interrupt"],
)
def test_a_failed_run_closes_its_parts_in_reverse(tmp_path, closes, monkeypatch, error):
    _fail_in_the_update(monkeypatch, error)
    with pytest.raises(type(error)):
        grpo_ds.train(TINY, _overrides(tmp_path))
    assert closes == CLOSED_IN_ORDER  # each exactly once: nothing closed early, nothing left open


# ------------------------------------------------------------------------ split: the rollout ranks


@pytest.mark.slow
def test_the_rollout_ranks_end_with_the_trainers_verdict(tmp_path):
    """Split placement through the deepspeed launcher (1 trainer + 1 rollout rank): the same command
    again on a finished run ends at once on both ranks with exit 0 (the rollout rank used to wait
    10 minutes for the bridge), and a refusal the trainer's rank 0 makes before anything loads (the
    run folder holds another recipe's run) is one line and exit 2 on both, with no traceback (the
    rollout rank used to die in the bridge's start-up with C++ frames); and so is a refusal either
    side makes once both have started loading (benchmarks/refusals.py launches each 5 times, on 2
    and 3 ranks, colocated and split)."""
    args = [
        "--module",
        "grpo_ds.train",
        str(REPO / TINY),
        f"run.output_dir={tmp_path / 'runs'}",
        'rollout.placement="split"',
        "rollout.ranks=1",
        "train.steps=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "train.micro_batch_samples_per_gpu=4",
        "logging.progress_bar=false",
    ]

    exits = tmp_path / "exits"  # each rank's exit code, as grpo_ds.launch reads them

    def launch(*overrides: str) -> subprocess.CompletedProcess:
        port = free_port()
        shutil.rmtree(exits, ignore_errors=True)
        exits.mkdir()
        try:
            return subprocess.run(
                launch_command(2, [*args, *overrides], port),
                cwd=tmp_path,
                env={**clean_env(), EXITS_VAR: str(exits), "PYTHONPATH": f"{tmp_path}:{REPO}"},
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            remove_shm_buffers(port)

    first = launch()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = launch()
    output = again.stdout + again.stderr
    assert again.returncode == 0 and output.count("nothing to do") == 1, output[-3000:]
    refused = launch("algorithm.rollout_is_cap=2.0")
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "Broken pipe" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error: " in line]
    assert len(errors) == 1 and "holds another recipe's run" in errors[0], output[-3000:]

    # refusals after the verdict, once the sides have started loading: the trainer's (LoRA adapters
    # with no module to go on, as the policy is built) and the rollout rank's (reward functions its
    # workers cannot import); each is one line and exit 2 on both ranks (the other side used to die
    # in the bridge with a traceback, or exit 1 with a second line)
    (tmp_path / "worker_only_fails.py").write_text(WORKER_ONLY_FAILS)
    for where, extra, said in [
        (
            "trainer",
            ["model.lora_rank=4", 'model.lora_target_modules=["nonexistent_proj"]'],
            "error: model.lora_target_modules: peft cannot place the adapters",
        ),
        (
            "rollout",
            ['reward.functions=[{"name": "worker_only_fails:exact_match"}]'],
            "rank 1: error: reward.functions: a reward worker process could not load",
        ),
    ]:
        refused = launch(f"run.output_dir={tmp_path / where}", *extra)
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2, output[-3000:]
        assert "Traceback" not in output and "Broken pipe" not in output, output[-3000:]
        errors = [line for line in output.splitlines() if "error: " in line]
        assert len(errors) == 1 and errors[0].startswith(said), output[-3000:]
        assert recorded_exits(exits) == {0: 2, 1: 2}, where
