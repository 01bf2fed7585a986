"""Mixture-of-experts models as a tested family: the builtin tiny MoE (model.tiny_num_experts), tiny
Mixtral and OLMoE folders, the routers' load-balancing loss (model.router_aux_loss_coef: its metric,
and its refusals) and the memory estimate's count of the experts. The layout-invariance of an MoE
step is tests/step/test_update.py's."""

import dataclasses
import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import grpo_ds
from grpo_ds import check
from grpo_ds.algo.router import load_balancing_loss
from grpo_ds.check import estimate_memory, simulated_lengths
from grpo_ds.config.loading import load_recipe
from grpo_ds.errors import UserError
from grpo_ds.model import memory
from grpo_ds.model.memory import model_shape
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.run.preflight import prepare_inputs
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")
MOE = {"model.tiny_num_experts": 8, "model.tiny_experts_per_token": 2}
# a tiny shape for the Mixtral and OLMoE folders: 4 experts of intermediate 32 in each of 2 layers
SHAPE = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=1,
)


def _small(tmp_path, **overrides) -> dict:
    return {
        "run.output_dir": str(tmp_path / "runs"),
        "train.steps": 2,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 8,
        "logging.progress_bar": False,
        "checkpoint.every_steps": None,
        **overrides,
    }


def test_the_tiny_moe_is_qwen3_moe_with_fused_experts_and_seeded_weights():
    model = build_tiny_model(103, hidden_size=32, num_layers=2, num_heads=4, seed=3, num_experts=8)
    assert isinstance(model, Qwen3MoeForCausalLM)
    # one tensor a layer holds all its experts: ZeRO-3 gathers them together
    for layer in model.model.layers:
        assert layer.mlp.experts.gate_up_proj.shape == (8, 2 * 32, 32)
        assert layer.mlp.experts.down_proj.shape == (8, 32, 32)
    again = build_tiny_model(103, hidden_size=32, num_layers=2, num_heads=4, seed=3, num_experts=8)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    assert (
        type(build_tiny_model(103, hidden_size=32, num_layers=1, num_heads=4)).__name__
        == "LlamaForCausalLM"
    )


def test_a_saved_tiny_moe_folder_reloads_with_its_character_tokenizer(tmp_path):
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(
        len(tokenizer), hidden_size=32, num_layers=1, num_heads=4, num_experts=4
    ).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (
        AutoTokenizer.from_pretrained(tmp_path)("1+2=3 ab").input_ids
        == tokenizer("1+2=3 ab").input_ids
    )
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), Qwen3MoeForCausalLM)


def test_the_load_balancing_loss_is_transformers_and_leaves_padding_out():
    """grpo_ds.algo.router's L_aux equals transformers' load_balancing_loss_func, with and without
    an attention mask, and padding rows change nothing."""
    g = torch.Generator().manual_seed(0)
    # 3 layers, 2 rows of 7 positions
    logits = [torch.randn(2 * 7, 8, generator=g) for _ in range(3)]
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    for m in (None, mask):
        ours = load_balancing_loss(logits, 2, m)
        torch.testing.assert_close(
            ours, load_balancing_loss_func(tuple(logits), 8, 2, m), rtol=1e-6, atol=0
        )
    real = [layer.view(2, 7, 8)[mask.bool()] for layer in logits]  # the 11 real rows alone
    torch.testing.assert_close(
        load_balancing_loss(logits, 2, mask), load_balancing_loss(real, 2), rtol=1e-6, atol=0
    )
    # equal probabilities: top-k takes the first 2, P_e = 1/8
    uniform = load_balancing_loss([torch.zeros(5, 8)], 2)
    assert uniform.item() == pytest.approx(8 * 2 * (5 * 1 / 5) * (1 / 8) / 1)


@pytest.mark.slow
def test_a_tiny_moe_trains_logs_its_router_loss_and_saves_the_coefficient(tmp_path):
    """model.router_aux_loss_coef > 0: each step logs router_aux_loss (L_aux averaged over the
    micro-batches by their response tokens: between 0 and E, k where the routing is uniform); off,
    the metric is absent. The final model is a Qwen3-MoE folder whose config records the coefficient
    the run trained with. The hf engine in float32 at staleness 0 routes as the trainer does: the
    importance weights are 1 (docs/guides/large-models.md, routing replay)."""
    on = grpo_ds.train(
        TINY,
        _small(
            tmp_path,
            **MOE,
            **{
                "model.router_aux_loss_coef": 0.05,
                "run.name": "on",
                "algorithm.rollout_is_cap": 2.0,
            },
        ),
    )
    assert len(on) == 2 and all(0 < m["router_aux_loss"] <= 8 for m in on)
    assert all(
        abs(m["is_weight_mean"] - 1) < 1e-5 and m["sampler_logprob_gap_max"] < 1e-5 for m in on
    )
    # a random router is close to uniform
    assert all(abs(m["router_aux_loss"] - 2) < 0.5 for m in on)
    saved = json.loads((tmp_path / "runs" / "on" / "final_model" / "config.json").read_text())
    assert saved["model_type"] == "qwen3_moe" and saved["router_aux_loss_coef"] == 0.05
    off = grpo_ds.train(
        TINY, _small(tmp_path, **MOE, **{"run.name": "off", "run.save_final_model": False})
    )
    assert all("router_aux_loss" not in m for m in off)


def _folder(tmp_path, name: str) -> str:
    """A random tiny Mixtral or OLMoE with the builtin tokenizer, saved as a model folder."""
    tokenizer = build_tiny_tokenizer()
    config, cls = {
        "mixtral": (MixtralConfig(num_local_experts=4, **SHAPE), MixtralForCausalLM),
        "olmoe": (OlmoeConfig(num_experts=4, **SHAPE), OlmoeForCausalLM),
    }[name]
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / name)
    tokenizer.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_mixtral_and_olmoe_folders_train_under_zero3_with_their_router_loss(tmp_path, name):
    """Loaded partitioned (ZeRO-3 on one rank: zero.Init and the folder's weights scattered), one
    step with the routers' loss, its metric logged; the memory estimate counts every expert's
    parameters."""
    path = _folder(tmp_path, name)
    metrics = grpo_ds.train(
        TINY,
        _small(
            tmp_path,
            **{
                "model.path": path,
                "model.router_aux_loss_coef": 0.01,
                "train.zero3_on_one_rank": True,
                "train.steps": 1,
                "run.save_final_model": False,
            },
        ),
    )
    assert 0 < metrics[0]["router_aux_loss"] <= 4
    recipe = load_recipe(TINY, {"model.path": path})
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model_shape(recipe, len(build_tiny_tokenizer())).params == sum(
        p.numel() for p in model.parameters()
    )


def _refusal(overrides: dict, world: int = 1) -> str:
    """The command line's error line (``error: `` + the UserError)."""
    with pytest.raises(UserError) as info:
        prepare_inputs(TINY, overrides, world, "cpu")
    return f"error: {info.value}"


def test_the_router_loss_is_refused_for_a_dense_model_and_autotp_for_an_moe(tmp_path):
    """Each a one-line UserError before any model loads."""
    assert _refusal({"model.router_aux_loss_coef": 0.01}) == (
        "error: model.router_aux_loss_coef: 0.01 for a dense model (builtin:tiny has no experts). "
        "set it to 0, or set model.tiny_num_experts for a builtin mixture of experts."
    )
    dense = tmp_path / "dense"
    build_tiny_model(103, hidden_size=32, num_layers=1, num_heads=4).save_pretrained(dense)
    build_tiny_tokenizer().save_pretrained(dense)
    assert _refusal({"model.path": str(dense), "model.router_aux_loss_coef": 0.01}).startswith(
        "error: model.router_aux_loss_coef: 0.01 for a "
        f"dense model ({dense}/config.json has no experts)"
    )
    assert _refusal({**MOE, "model.tiny_experts_per_token": 9}).startswith(
        "error: model.tiny_experts_per_token: 9 is more than tiny_num_experts 8"
    )
    assert _refusal({**MOE, "train.tensor_parallel_size": 2}, world=2).startswith(
        "error: train.tensor_parallel_size: 2 with a "
        "mixture-of-experts model (builtin:tiny): DeepSpeed's AutoTP"
    )
    assert "\n" not in _refusal({**MOE, "train.tensor_parallel_size": 2}, world=2)


def test_the_memory_estimate_counts_every_expert_and_each_tokens_experts():
    """grpo_ds.check's estimate (grpo_ds.model.memory) of the tiny MoE: its parameters are every
    expert's (E x 3 x i' x h a layer), split over dp under ZeRO-3; ZeRO-3 gathers a layer's experts
    at once (the largest module); a token's activations in an MoE layer are k(4i' + 3h) + 2E values
    instead of a dense MLP's 4i (benchmarks/RESULTS.md: 'Memory estimate vs measured: mixture of
    experts' holds the measured error)."""
    overrides = {
        **MOE,
        "model.tiny_hidden_size": 64,
        "model.tiny_num_layers": 2,
        "rollout.max_new_tokens": 8,
    }
    inputs = prepare_inputs(TINY, overrides, 2, "cpu")
    shape = model_shape(inputs.recipe, len(inputs.tokenizer))
    model = build_tiny_model(
        len(inputs.tokenizer), hidden_size=64, num_layers=2, num_heads=4, num_experts=8
    )
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (
        shape.moe_layers,
        shape.experts,
        shape.experts_per_token,
        shape.expert_intermediate,
    ) == (2, 8, 2, 64)
    assert shape.largest_layer == 8 * 3 * 64 * 64  # one layer's fused experts
    est = estimate_memory(
        inputs.recipe, shape, inputs.ds_config, 2, simulated_lengths(inputs, "max")
    )
    assert est.device["policy weights"] == shape.params * 4 // 2
    assert (
        f"({shape.params / 1e6:.2f} M parameters, a mixture "
        "of experts: 8 in each of 2 layers, 2 per token," in check.report(inputs, 2, "max")
    )
    dense = dataclasses.replace(
        shape, moe_layers=0, experts=0, experts_per_token=0, expert_intermediate=0
    )
    tokens, longest = 1000, 20
    moe_bytes = memory._update_bytes(inputs.recipe, shape, 4, 1, tokens, longest, "torch")
    dense_bytes = memory._update_bytes(inputs.recipe, dense, 4, 1, tokens, longest, "torch")
    per_token_layer = 2 * (4 * 64 + 3 * 64) + 2 * 8 - 4 * shape.intermediate
    assert moe_bytes - dense_bytes == tokens * 2 * per_token_layer * 4
