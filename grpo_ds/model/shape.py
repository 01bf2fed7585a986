"""The model's and the reward models' shapes, which the memory estimate (grpo_ds.model.memory)
counts with: read from their configs, each model built on the meta device (no weights, no memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_ds.config.recipe import Recipe
from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.model import lora


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of the model, read from its config on the meta device (no
    weights)."""

    params: int  # every parameter (LoRA: base + adapters)
    trainable: int  # the trained ones (LoRA: the adapters)
    split: int  # parameters AutoTP splits over tensor-parallel ranks (the decoder's linear layers)
    largest_layer: int  # parameters of the largest module ZeRO-3 gathers at once
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    # layers whose MLP is a mixture of experts (their parameters: every expert's, in params)
    moe_layers: int = 0
    experts: int = 0  # E: experts per MoE layer
    experts_per_token: int = 0  # k: experts each token is routed to
    expert_intermediate: int = 0  # i': an expert's intermediate size


@dataclass(frozen=True)
class RewardModelShape:
    """What the estimate needs to know of a reward model (reward.models): frozen, no optimizer, no
    gradients."""

    name: str  # its metrics' name, and its lines' in the estimate (``reward_model_line``)
    params: int  # every parameter, the score head included
    offload: bool  # its weights in host memory between steps


def model_shape(recipe: Recipe, vocab_size: int) -> ModelShape:
    """The model's shape from its config, built on the meta device (no weights, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_ds.model.loading import BUILTIN_TINY
    from grpo_ds.model.tiny import build_tiny_model, tiny_shape

    m = recipe.model
    with torch.device("meta"):
        if m.path == BUILTIN_TINY:
            model = build_tiny_model(vocab_size, **tiny_shape(m))
        else:
            config = AutoConfig.from_pretrained(
                m.path, trust_remote_code=m.trust_remote_code, local_files_only=True
            )
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
        config = model.config
        head = model.get_output_embeddings()
        split = sum(
            p.numel()
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
            for p in module.parameters(recurse=False)
        )
        largest = max(
            sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()
        )
        moe = _moe_shape(model)
        if lora.enabled(m):
            model = lora.apply_lora(model, m)
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    heads = config.num_attention_heads
    return ModelShape(
        params,
        trainable,
        split,
        largest,
        config.hidden_size,
        config.num_hidden_layers,
        getattr(config, "intermediate_size", 4 * config.hidden_size),
        heads,
        getattr(config, "num_key_value_heads", None) or heads,
        config.vocab_size,
        *moe,
    )


def _moe_shape(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(MoE layers, experts per layer, experts per token, an expert's intermediate size) of a model
    whose experts are transformers 5's fused modules (``*Experts``: num_experts, intermediate_dim,
    3-D weight tensors); zeros for a dense model."""
    found = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "num_experts", None), int)
        and any(p.dim() == 3 for p in m.parameters(recurse=False))
    ]
    if not found:
        return 0, 0, 0, 0
    first = found[0]
    intermediate = getattr(first, "intermediate_dim", None) or first.down_proj.shape[-1]
    return len(found), first.num_experts, model.config.num_experts_per_tok, intermediate


def reward_model_shape(spec: RewardModelSpec) -> RewardModelShape:
    """A reward model's parameters from its config.json, the model built on the meta device (no
    weights, no memory); the folder was checked before (grpo_ds.model.reward_model_checks)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return RewardModelShape(spec.name, sum(p.numel() for p in model.parameters()), spec.offload)
