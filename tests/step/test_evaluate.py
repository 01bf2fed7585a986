"""Evaluation during training: the pass@k estimator by hand, and eval metrics in a short run."""

import pytest

import grpo_ds
from grpo_ds.config.loading import load_recipe
from grpo_ds.errors import UserError
from grpo_ds.step.evaluate import pass_at_k
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 4, 1.0),  # n - c < k: some draw of 4 always holds the correct one
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5) = 21, C(10,5) = 252
        (4, 4, 2, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_beyond_the_samples_is_a_load_time_error():
    with pytest.raises(UserError, match=r"eval.pass_at: \[1, 8\] must be a non-empty list"):
        load_recipe({"eval": {"data": "builtin:arith", "samples_per_prompt": 4, "pass_at": [1, 8]}})


@pytest.mark.slow
def test_eval_metrics_every_k_steps_and_at_the_end(tmp_path):
    metrics = grpo_ds.train(
        TINY,
        {
            "run.output_dir": str(tmp_path),
            "train.steps": 3,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "train.micro_batch_samples_per_gpu": 16,
            "logging.progress_bar": False,
            "eval.data": "builtin:arith",
            "eval.every_steps": 2,
            "eval.max_prompts": 6,
            "eval.samples_per_prompt": 4,
            "eval.pass_at": [1, 4],
            "eval.correct_at": 1.0,
        },
    )
    # step 2, then the last step
    assert ["eval/pass@1" in m for m in metrics] == [False, True, True]
    for m in metrics[1:]:
        for key in (
            "eval/greedy_accuracy",
            "eval/greedy_reward_mean",
            "eval/reward_mean",
            "eval/pass@1",
            "eval/pass@4",
        ):
            assert 0.0 <= m[key] <= 1.0, key
        assert m["eval/pass@4"] >= m["eval/pass@1"]
        assert m["time_eval_s"] > 0


def test_a_bad_eval_dataset_is_named_before_any_model_loads():
    from grpo_ds.run.preflight import prepare_inputs

    with pytest.raises(UserError) as err:
        prepare_inputs(TINY, {"eval.data": "builtin:arithh"}, 1, "cpu")
    assert err.value.where == "eval.data" and "did you mean" in err.value.fix
