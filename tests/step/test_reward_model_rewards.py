"""Learned reward models in the driver (grpo_ds.step.collect): their scores join the reward
functions' with their weights, their phase is timed and is a phase of the memory timeline, and a run
whose only reward is a reward model learns what it rewards (recipes/rm_tiny_cpu.json, its model
written by the documented one-line command).

Scores against a plain transformers forward, across world sizes, packing and offload:
tests/reward_models/; scored on the trainer ranks under split placement:
tests/step/test_schedule.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import grpo_ds
from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.reward_models.render import render_texts
from grpo_ds.reward_models.tiny import write_digit_reward_model
from grpo_ds.run.builtin_models import BUILTIN_VERSION
from grpo_ds.step.memory_timeline import read_rows
from grpo_ds.step.profiling import memory_path
from tests.launch import REPO, clean_env

RECIPE = REPO / "recipes" / "rm_tiny_cpu.json"
# the check: 0,1,2
SEEDS = [int(s) for s in os.environ.get("GRPO_DS_RM_SEEDS", "0").split(",")]


def _digit_model(folder):
    write_digit_reward_model(folder)
    return str(folder)


@pytest.mark.slow
def test_a_function_and_a_model_add_up_with_their_weights_and_the_phase_is_timed(tmp_path):
    model = _digit_model(tmp_path / "digit7")
    metrics = grpo_ds.train(
        REPO / "recipes" / "tiny_cpu.json",
        {
            "run.output_dir": str(tmp_path),
            "train.steps": 2,
            "logging.progress_bar": False,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 8,
            "checkpoint.every_steps": None,
            "run.save_final_model": False,
            "logging.profile_steps": [1, 2],
            "logging.profile_trace": False,
            "reward.functions": [{"name": "format", "weight": 0.5}],
            "reward.models": [
                {"path": model, "name": "digit7", "weight": 2.0, "mean": 0.1, "std": 0.5}
            ],
        },
    )
    for m in metrics:
        assert m["reward_mean"] == pytest.approx(
            0.5 * m["reward/format"] + 2.0 * m["reward/digit7"], abs=1e-9
        )
        # (score - 0.1) / 0.5 with scores in [0, 0.28): the normalisation applied
        assert m["reward/digit7"] < 0
        assert m["time_reward_model_s"] > 0 and m["reward_truncated/digit7"] == 0
    phases = {row.phase for row in read_rows(memory_path(tmp_path / "tiny_cpu", 0))}
    assert "reward_model" in phases


def _best_score(folder) -> float:
    """The digit model's score of the best completion (max_new_tokens sevens): every builtin:arith
    prompt has four characters and no seven, so it is the same for every prompt."""
    recipe = json.loads(RECIPE.read_text())
    spec = RewardModelSpec(**recipe["reward"]["models"][0])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    text = render_texts(spec, tokenizer, ["0+0="], ["7" * recipe["rollout"]["max_new_tokens"]])[0]
    with torch.no_grad():
        logit = model(**tokenizer(text, return_tensors="pt")).logits.item()
    return (logit - spec.mean) / spec.std


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_the_reward_model_recipe_learns_what_its_model_rewards(tmp_path, seed):
    """The guide's command from a folder holding recipes/ and ds_configs/, as a fresh checkout has
    them: the recipe names builtin:digit7, which the run writes into grpo_ds's cache on first use,
    and, with that model as its only reward, reaches >= 0.9 of the best score (last-10 mean)."""
    for folder in ("recipes", "ds_configs"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = {**clean_env(), "GRPO_DS_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_ds.train",
            "recipes/rm_tiny_cpu.json",
            f"run.seed={seed}",
            "logging.progress_bar=false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [
        json.loads(line)
        for line in (tmp_path / "runs" / "rm_tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    best = _best_score(tmp_path / "cache" / "builtin" / f"digit7_rm-v{BUILTIN_VERSION}")
    # the recipe's std makes the best completion score 1
    assert best == pytest.approx(1.0, abs=0.01)
    first = sum(m["reward_mean"] for m in lines[:10]) / 10
    last = sum(m["reward_mean"] for m in lines[-10:]) / 10
    assert first < 0.3 * best and last >= 0.9 * best, (first, last, best)
    # its only reward
    assert all(m["reward_mean"] == pytest.approx(m["reward/digit7"], abs=1e-12) for m in lines)
