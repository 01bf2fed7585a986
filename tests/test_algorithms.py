"""Every algorithm option runs through the driver (two short steps each) and reports what it did."""

import pytest

import grpo_ds
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")
BASE = {"train.steps": 2, "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 3,
        "train.micro_batch_samples_per_gpu": 4, "logging.progress_bar": False}


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "expected_keys"), [
    ({"algorithm.advantage": "rloo"}, []),
    ({"algorithm.advantage": "reinforce_pp"}, []),
    ({"algorithm.advantage": "dr_grpo", "algorithm.loss_agg": "seq-mean-token-sum-norm"}, []),
    ({"algorithm.policy_loss": "gspo", "algorithm.loss_agg": "seq-mean-token-mean", "algorithm.clip_low": 3e-4,
      "algorithm.clip_high": 4e-4, "train.samples_per_optimizer_step": 8}, []),
    ({"algorithm.dual_clip": 3.0, "train.samples_per_optimizer_step": 8}, []),
    ({"algorithm.kl_coef": 0.1, "algorithm.kl_estimator": "k2"}, []),
    ({"algorithm.kl_coef": 0.1, "algorithm.kl_in_reward": True, "algorithm.kl_estimator": "k1"},
     ["reward/kl_penalty"]),
    ({"algorithm.rollout_is_cap": 2.0}, ["is_weight_mean", "is_truncated_frac"]),
    ({"algorithm.mask_truncated": True}, []),
    ({"algorithm.overlong_buffer_tokens": 1}, ["reward/overlong_penalty"]),
    ({"algorithm.dynamic_sampling": True, "algorithm.dynamic_sampling_max_rounds": 1},
     ["dynamic/rounds", "dynamic/prompts_drawn", "dynamic/informative_groups", "dynamic/topped_up_groups"]),
    ({"kernels.fused_lm_head": False, "algorithm.policy_loss": "gspo", "algorithm.loss_agg": "seq-mean-token-mean"},
     []),
], ids=lambda v: ",".join(f"{k.split('.')[-1]}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_algorithm_option_runs(tmp_path, overrides, expected_keys):
    metrics = grpo_ds.train(TINY, {**BASE, "run.output_dir": str(tmp_path), **overrides})
    assert len(metrics) == 2
    for m in metrics:
        assert all(key in m for key in expected_keys), sorted(m)
        assert m["loss"] == m["loss"]  # not NaN
    if "algorithm.rollout_is_cap" in overrides:
        # The hf engine samples from softmax(logits / T) (no top-p/k here), the trainer scores the same: the
        # weights are ~1 and never truncated.
        assert all(abs(m["is_weight_mean"] - 1.0) < 1e-3 and m["is_truncated_frac"] == 0.0 for m in metrics)
    if "algorithm.dynamic_sampling" in overrides:
        assert all(m["dynamic/prompts_drawn"] == 4 * m["dynamic/rounds"] for m in metrics)


def test_truncated_completions_get_no_weight():
    from grpo_ds.recipe import load_recipe
    from grpo_ds.rollout.base import Rollouts
    from grpo_ds.update import UpdateSettings, trained_tokens

    rollouts = Rollouts([[1], [1]], [[5, 6], [5, 1]], [[0.0, 0.0]] * 2, ["length", "stop"], [[1, 1], [1, 0]])
    on = UpdateSettings.from_recipe(load_recipe({"algorithm": {"mask_truncated": True}}), 0, "torch")
    off = UpdateSettings.from_recipe(load_recipe({}), 0, "torch")
    assert [trained_tokens(rollouts, i, on) for i in range(2)] == [0, 1]  # truncated: out; loss mask counts
    assert [trained_tokens(rollouts, i, off) for i in range(2)] == [2, 1]


@pytest.mark.slow
def test_observability_peak_memory_and_sample_completions(tmp_path):
    import json

    metrics = grpo_ds.train(TINY, {**BASE, "train.steps": 3, "run.output_dir": str(tmp_path), "run.name": "obs",
                                   "logging.samples_every_steps": 2, "logging.samples_per_log": 3})
    assert all(0.05 < m["peak_memory_gib"] < 64 for m in metrics)  # resident memory of this process, GiB
    records = [json.loads(line) for line in (tmp_path / "obs" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # the first step, then every 2 steps
    first = records[0]["samples"]
    assert len(first) == 3 and all(set(s) == {"prompt", "completion", "reward"} for s in first)
    assert first[0]["prompt"].endswith("=")  # builtin:arith prompts such as "3+4="
