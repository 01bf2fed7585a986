"""The NaN guard: a non-finite loss skips the update (logged, no checkpoint of that step); K in a
row stop the run with one clear line and the last good checkpoint intact."""

import pytest

import grpo_ds
import grpo_ds.step.schedule as schedule_module
import grpo_ds.step.update as update_module
from grpo_ds.errors import UserError
from grpo_ds.model.policy import weights_sha256
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")


REWARDS = """
def parity(*, completions, **kwargs):
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]
"""


@pytest.fixture(autouse=True)
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "nan_rewards.py").write_text(REWARDS)  # rewards with signal from the first step on
    monkeypatch.syspath_prepend(str(tmp_path))


def _small(tmp_path, **overrides):
    base = {
        "run.output_dir": str(tmp_path),
        "run.name": "nan",
        "train.steps": 4,
        "rollout.prompts_per_step": 4,
        "reward.functions": [{"name": "nan_rewards:parity"}],
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 4,
        "logging.progress_bar": False,
        "checkpoint.every_steps": 1,
        "checkpoint.keep": 10,
    }
    return {**base, **overrides}


@pytest.fixture
def inject(monkeypatch):
    """Make the loss NaN in the given steps (counted by driver step); record the policy's weights'
    hash at each step's weight sync (which runs whether or not the rollout engine shares the
    policy's module)."""
    state = {"step": 0, "nan_steps": set(), "hashes": []}
    real_loss, real_sync = update_module.micro_batch_loss, schedule_module.sync_weights

    def loss(*args, **kwargs):
        value, stats = real_loss(*args, **kwargs)
        return (value * float("nan") if state["step"] in state["nan_steps"] else value), stats

    def sync(policy, rollout, bucket_bytes):
        state["hashes"].append(weights_sha256(policy.full_weights(bucket_bytes)))
        real_sync(policy, rollout, bucket_bytes)

    real_collect = schedule_module.collect

    def collect(step, *args, **kwargs):
        state["step"] = step
        return real_collect(step, *args, **kwargs)

    monkeypatch.setattr(update_module, "micro_batch_loss", loss)
    # the colocated schedule's weight sync
    monkeypatch.setattr(schedule_module, "sync_weights", sync)
    monkeypatch.setattr(schedule_module, "collect", collect)
    return state


@pytest.mark.slow
def test_a_nan_loss_skips_the_update_and_the_run_goes_on(tmp_path, inject):
    inject["nan_steps"] = {2}
    metrics = grpo_ds.train(TINY, _small(tmp_path))
    assert [m["nonfinite_optimizer_steps"] for m in metrics] == [0, 1, 0, 0]
    assert metrics[1]["grad_norm"] != metrics[1]["grad_norm"]  # NaN: no update to measure
    # every step has signal, so every update moves the weights
    assert all(m["reward_std"] > 0 for m in metrics)
    h = inject["hashes"]
    assert h[0] == h[1] != h[2] != h[3]  # synced after steps 1-4: step 2 changed nothing
    saved = sorted(p.name for p in (tmp_path / "nan" / "checkpoints").glob("step_*"))
    assert saved == ["step_00000001", "step_00000003", "step_00000004"]  # none of the NaN step


@pytest.mark.slow
def test_nan_losses_in_a_row_stop_the_run_with_the_last_good_checkpoint(tmp_path, inject):
    inject["nan_steps"] = {2, 3, 4}
    with pytest.raises(UserError) as err:
        grpo_ds.train(TINY, _small(tmp_path, **{"train.max_nonfinite_steps": 2}))
    message = str(err.value)
    assert message.startswith("step 3: 2 optimizer steps in a row had a non-finite loss")
    assert "the last good checkpoint is " in message and message.count("step_00000001") == 1
    assert sorted(p.name for p in (tmp_path / "nan" / "checkpoints").glob("step_*")) == [
        "step_00000001"
    ]
