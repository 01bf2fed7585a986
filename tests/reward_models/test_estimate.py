"""A reward model in the memory estimate (grpo_ds/model/memory.py) and in the dry run's report
(grpo_ds.check): its parameters counted from config.json without weights, its weights counted like
the reference model's (model.dtype, 1/dp under ZeRO-3, no optimizer or gradients), in host memory
with offload, and within 10% of what the loaded partitioned weights measure."""

import os
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from grpo_ds import check
from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.model.memory import GIB, ModelShape, RewardModelShape, estimate, reward_model_shape
from grpo_ds.run.preflight import prepare_inputs
from tests.reward_models.builders import write_reward_model
from tests.scripts.cli_forks import run_forked

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_cpu.json"
SHAPE = ModelShape(
    params=7_000_000_000,
    trainable=7_000_000_000,
    split=6_000_000_000,
    largest_layer=500_000_000,
    hidden=4096,
    layers=32,
    intermediate=11008,
    heads=32,
    kv_heads=32,
    vocab=32000,
)
RM = 1_000_000_000  # parameters of the reward model of the unit tests


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_reward_model(
        tmp_path_factory.mktemp("rm") / "helpful_rm",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
    )


def _estimate(world=8, reward_models=(), deepspeed="ds_configs/zero3.json", **sections):
    recipe = load_recipe({"deepspeed": deepspeed, **sections})
    return estimate(
        recipe,
        SHAPE,
        resolve_deepspeed_config(recipe, world, "cpu"),
        world,
        4096,
        1024,
        32,
        reward_models=reward_models,
    )


def test_the_parameter_count_is_the_models_own_without_loading_weights(folder):
    shape = reward_model_shape(RewardModelSpec(path=str(folder), offload=True))
    loaded = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True)
    assert shape == RewardModelShape(
        "helpful_rm", sum(p.numel() for p in loaded.parameters()), True
    )


@pytest.mark.parametrize(("dtype", "width"), [("float32", 4), ("bfloat16", 2)])
def test_a_reward_model_is_counted_like_the_reference_model(dtype, width):
    plain = _estimate(model={"dtype": dtype}, algorithm={"kl_coef": 0.1})
    with_rm = _estimate(
        model={"dtype": dtype},
        algorithm={"kl_coef": 0.1},
        reward_models=(
            RewardModelShape("rm", RM, False),
            RewardModelShape("safety", SHAPE.params, False),
        ),
    )
    assert with_rm.device["reward model rm"] == RM * width / 8  # ZeRO-3 over dp 8, in model.dtype
    # a same-size model: the same
    assert with_rm.device["reward model safety"] == with_rm.device["reference model"]
    assert (
        with_rm.peak - plain.peak
        == with_rm.device["reward model rm"] + with_rm.device["reward model safety"]
    )
    # no optimizer, gradients or phase
    assert with_rm.host == plain.host and with_rm.phases == plain.phases


def test_outside_zero3_each_rank_holds_the_whole_reward_model():
    # stage 1 at one rank
    one_rank = _estimate(world=1, reward_models=(RewardModelShape("rm", RM, False),))
    assert one_rank.device["reward model rm"] == RM * 4


def test_offload_keeps_it_in_host_memory_except_while_it_scores():
    on = _estimate(reward_models=(RewardModelShape("rm", RM, False),))
    off = _estimate(reward_models=(RewardModelShape("rm", RM, True),))
    assert "reward model rm" not in off.device and off.host["reward model rm"] == RM * 4 / 8
    assert off.phases["reward scoring (offloaded weights on the device)"] == RM * 4 / 8
    assert off.persistent == on.persistent - RM * 4 / 8
    # the update, not the scoring, is the peak
    assert off.peak == on.peak - RM * 4 / 8 and off.total == on.total


def test_the_share_is_within_10_percent_of_the_loaded_partitioned_weights(folder, tmp_path):
    """World size 1 under ZeRO-3 (train.zero3_on_one_rank), bfloat16: the report's bytes against the
    partitions that zero.Init gives the model loaded with transformers' DeepSpeed integration alive
    (as grpo_ds loads the reference model), in-process."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from grpo_ds.distributed.ranks import init_distributed

    overrides = [
        "train.zero3_on_one_rank=true",
        "model.dtype=bfloat16",
        f"run.output_dir={tmp_path / 'out'}",
        f'reward.models=[{{"path": "{folder}"}}]',
    ]
    inputs = prepare_inputs(RECIPE, overrides, 1, "cpu")
    assert inputs.ds_config["zero_optimization"]["stage"] == 3
    shape = check.memory.model_shape(inputs.recipe, len(inputs.tokenizer))
    est = check.estimate_memory(
        inputs.recipe,
        shape,
        inputs.ds_config,
        1,
        check.simulated_lengths(inputs, "max"),
        reward_models=(reward_model_shape(inputs.reward_models[0]),),
    )
    init_distributed()
    alive = HfDeepSpeedConfig(
        {k: v for k, v in inputs.ds_config.items() if k != "train_batch_size"}
    )
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=torch.bfloat16, local_files_only=True
        )
    finally:
        unset_hf_deepspeed_config()
        del alive
    params = list(model.parameters())
    # partitioned: nothing held whole
    assert all(hasattr(p, "ds_tensor") and p.numel() == 0 for p in params)
    measured = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
    assert est.device["reward model helpful_rm"] == pytest.approx(measured, rel=0.10)


def _report_line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert len(found) == 1, f"no single line starting {start!r} in:\n{text}"
    return found[0]


def test_the_report_prints_each_reward_model_and_its_share(folder, tmp_path):
    models = (
        f'reward.models=[{{"path": "{folder}"}}, {{"path": '
        f'"{folder}", "name": "offloaded", "offload": true}}]'
    )
    inputs = prepare_inputs(RECIPE, [f"run.output_dir={tmp_path / 'out'}", models], 2, "cpu")
    text = check.report(inputs, 2, "max")
    params = sum(
        p.numel()
        for p in AutoModelForSequenceClassification.from_pretrained(
            folder, local_files_only=True
        ).parameters()
    )
    weights = params * 4 / 2  # float32 over 2 data-parallel ranks (ZeRO-3)
    estimate_line = _report_line(text, "  reward model helpful_rm ")
    assert float(estimate_line.split()[-2]) == pytest.approx(weights / GIB, abs=1e-3)
    assert _report_line(text, "  reward model offloaded (offloaded to host) ")
    peak = float(_report_line(text, "  peak on the device").split()[-2]) * GIB
    assert _report_line(text, "reward models (") == (
        "reward models (on every rank, like the reference model: "
        "model.dtype, partitioned under ZeRO-3, no optimizer)"
    )
    line = _report_line(text, "  helpful_rm: ")
    match = re.fullmatch(
        rf"  helpful_rm: {re.escape(str(folder))}, ([\d,]+) parameters, float32, ([\d.]+) MiB per "
        r"rank, ([\d.]+)% of the peak",
        line,
    )
    assert match, line
    assert int(match[1].replace(",", "")) == params
    assert float(match[2]) == pytest.approx(weights / 2**20, abs=0.01)
    assert float(match[3]) == pytest.approx(100 * weights / peak, abs=0.1)
    assert re.fullmatch(
        rf"  offloaded: {re.escape(str(folder))}, {params:,} parameters, float32, [\d.]+ MiB per "
        r"rank in host memory \(offload; on the device only while it scores\)",
        _report_line(text, "  offloaded: "),
    )
    assert "reward models" not in check.report(
        prepare_inputs(RECIPE, [f"run.output_dir={tmp_path / 'out'}"], 2, "cpu"), 2, "max"
    )


@pytest.mark.slow
def test_the_command_line_prints_the_reward_models(folder, tmp_path):
    """python -m grpo_ds.check (forked from a preloaded process, as tests/test_check.py runs it):
    exit 0, the reward model in the estimate and in its own block, nothing written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    workdir = tmp_path / "work"
    workdir.mkdir()
    argv = [
        "grpo_ds.check",
        str(RECIPE),
        "--world-size",
        "2",
        f'reward.models=[{{"path": "{folder}"}}]',
    ]
    (finished,) = run_forked([(argv, workdir)], env, tmp_path / "forks", timeout=300, parallel=1)
    assert finished.returncode == 0, finished.stderr
    assert "error:" not in finished.stderr and list(workdir.iterdir()) == []
    assert _report_line(finished.stdout, "  reward model helpful_rm ")
    assert _report_line(finished.stdout, "  helpful_rm: ").endswith("% of the peak")
