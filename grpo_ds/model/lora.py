"""LoRA adapters (through peft) on the ZeRO-3 policy: wrap, merge for the rollout engine, disable
for the reference.

``model.lora_rank`` turns it on. The policy is wrapped with peft before DeepSpeed sees it, so only
the adapter matrices require gradients and reach the optimizer; the base weights stay frozen,
partitioned like every other parameter, and bit-identical. Three things differ from full
fine-tuning:

- **Weight sync.** The rollout engine holds the plain base model (transformers' names), so only the
  adapted layers ever change there. ``merged_weights`` streams, for each adapted ``nn.Linear``,
  ``W + scaling * B @ A`` under the base name (``model.layers.0.self_attn.q_proj.weight``), through
  the bucketed ZeRO-3 exporter: a layer's A and B are gathered before its W (small: r x (in + out)),
  W is handed out as a private copy and the product is added in place, row block by row block. At
  most one bucket of gathered weights is alive, the merged copy and the layer's adapters included
  (both are counted in the bucket plan). Frozen weights that no adapter touches are never sent: the
  rollout copy already has them.
- **Reference model.** The KL reference is the base model: the policy with its adapters disabled
  (``adapters_disabled``), not a second copy of the weights.
- **Checkpoints** hold the adapters and the optimizer state only (``exclude_frozen_parameters``);
  resuming and exporting rebuild the base from ``model.path`` (builtin:tiny from ``run.seed``).

Only LoRA on linear layers is supported (peft's ``lora.Linear``); anything else peft would create
(embedding or convolution adapters, DoRA) is refused with the module's name, and so is an adapter on
an output layer that shares its weight with the input embedding (merging it would change the
embedding too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grpo_ds.config.recipe import ModelConfig
from grpo_ds.errors import UserError, first_line
from grpo_ds.model.weight_gather import gathered_named_parameters, gathered_parameters

ALL_LINEAR = "all-linear"
_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"
_MERGE_ROWS = 1024  # rows of W merged per block: the B @ A product never exists in full


def enabled(model_cfg: ModelConfig) -> bool:
    return model_cfg.lora_rank is not None


def lora_config(model_cfg: ModelConfig):
    """peft's LoraConfig for the recipe's model section."""
    from peft import LoraConfig

    targets = model_cfg.lora_target_modules
    return LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        lora_dropout=model_cfg.lora_dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, model_cfg: ModelConfig) -> torch.nn.Module:
    """``model`` wrapped by peft: adapters on the target modules, everything else frozen."""
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    try:
        wrapped = get_peft_model(model, lora_config(model_cfg))
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise UserError(
            "model.lora_target_modules",
            f"peft cannot place the adapters ({first_line(err)})",
            f'name linear modules of the model (e.g. ["q_proj", "v_proj"]), or ["{ALL_LINEAR}"]',
        ) from None
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    for name, module in wrapped.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if (
            not isinstance(module, LoraLinear)
            or module.use_dora.get(_ADAPTER)
            or module.fan_in_fan_out
        ):
            kind = type(module.get_base_layer()).__name__
            raise UserError(
                "model.lora_target_modules",
                f"{_base_name(name)} is a {kind}: only adapters on "
                "nn.Linear layers can be merged into the rollout engine",
                "target linear layers only",
            )
        if tied and module.get_base_layer() is output:
            raise UserError(
                "model.lora_target_modules",
                f"{_base_name(name)} shares its weight with the input "
                "embedding (tie_word_embeddings), so merging an adapter into it would change both",
                "leave the output layer out of the targets",
            )
    return wrapped


def summary(module: torch.nn.Module, rank: int) -> str:
    """One line for the console: what the adapters add (partitioned parameters counted whole)."""
    trainable = sum(_numel(p) for p in module.parameters() if p.requires_grad)
    total = sum(_numel(p) for p in module.parameters())
    layers = sum(
        1 for name, _ in module.named_parameters() if name.endswith(f".lora_A.{_ADAPTER}.weight")
    )
    return (
        f"LoRA: rank {rank} adapters on {layers} linear layers, {trainable:,} trainable parameters "
        f"of {total:,} ({100 * trainable / total:.2f}%)"
    )


@contextmanager
def adapters_disabled(engine):
    """The base model for the duration: the KL reference of a LoRA policy."""
    module = getattr(engine, "module", engine)
    with module.disable_adapter():
        yield


def merged_weights(
    module: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, W + scaling * B @ A) for every adapted linear layer of a peft ``module``, bucket
    by bucket.

    Each tensor is valid until the next one is requested (the exporter's rule); every rank must
    consume the whole iterator (the gathers are collective). See the module docstring for the memory
    bound.
    """
    from peft.tuners.lora import LoraLayer

    order, private, extra, layers = [], set(), {}, {}
    for name, layer in module.named_modules():
        if not isinstance(layer, LoraLayer) or _ADAPTER not in layer.lora_A:
            continue
        a, b, w = (
            layer.lora_A[_ADAPTER].weight,
            layer.lora_B[_ADAPTER].weight,
            layer.get_base_layer().weight,
        )
        order += [(a, ("A", name)), (b, ("B", name)), (w, ("W", name))]
        private.add(id(w))
        # the clones of A and B, from when each is handed out until W is merged (counted in every
        # bucket they may be alive in)
        extra[id(a)], extra[id(b)] = _full_bytes(a), _full_bytes(b)
        extra[id(w)] = extra[id(a)] + extra[id(b)]
        layers[name] = layer
    adapters: dict[str, torch.Tensor] = {}
    for (part, name), tensor in gathered_parameters(
        order, bucket_bytes, dtype, frozenset(private), extra
    ):
        if part != "W":
            adapters[part] = tensor.detach().clone()  # small; the exporter reuses its buffers
            continue
        _add_delta(tensor, adapters.pop("B"), adapters.pop("A"), layers[name].scaling[_ADAPTER])
        yield _base_name(name) + ".weight", tensor


def merged_model_weights(
    module: torch.nn.Module, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the merged model under the plain model's names: the frozen weights no adapter
    touches, then ``merged_weights`` (same validity rule; every rank must consume it)."""
    from peft.tuners.lora import LoraLayer

    adapted = {
        f"{name}.base_layer.weight"
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer) and _ADAPTER in layer.lora_A
    }

    def rename(name: str) -> str | None:
        if ".lora_" in name or name in adapted:
            return None
        owner, _, leaf = name.rpartition(".")
        return f"{_base_name(owner)}.{leaf}"

    yield from gathered_named_parameters(module, bucket_bytes, rename=rename)
    yield from merged_weights(module, bucket_bytes)


def layer_companions(
    module: torch.nn.Module, bucket_bytes: int, packed: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen tensors that complete the layers a LoRA sync touches, under the plain model's
    names: each adapted layer's other parameters (its bias), and the parameters of the layers a
    rollout engine fuses with an adapted one (``packed``, vLLM's packed_modules_mapping {"qkv_proj":
    ["q_proj", "k_proj", "v_proj"], ...}: with adapters on q_proj and v_proj, every k_proj beside
    them). A consumer that rebuilds each of its layers whole before it uses any (vLLM's in-place
    reload) needs them with ``merged_weights``, which sends only the adapted weights. Same validity
    rule as the exporter's; every rank must consume it."""
    from peft.tuners.lora import LoraLayer

    adapted = {
        name
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer) and _ADAPTER in layer.lora_A
    }
    siblings = set()
    for name in adapted:
        owner, _, leaf = name.rpartition(".")
        for members in packed.values():
            if leaf in members:
                siblings |= {f"{owner}.{m}" for m in members if f"{owner}.{m}" not in adapted}

    def rename(name: str) -> str | None:
        owner, _, leaf = name.rpartition(".")
        if owner in siblings:  # a frozen layer fused with an adapted one: all of it
            return f"{_base_name(owner)}.{leaf}"
        layer, _, base = owner.rpartition(".")
        # the adapted layer's bias
        if base == "base_layer" and layer in adapted and leaf != "weight":
            return f"{_base_name(layer)}.{leaf}"
        return None

    yield from gathered_named_parameters(module, bucket_bytes, rename=rename)


def _add_delta(weight: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float) -> None:
    """weight += (B @ A) * scaling in place, row block by row block, in float32 for half-precision
    weights."""
    compute = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    a = a.to(compute)
    for start in range(0, weight.shape[0], _MERGE_ROWS):
        rows = slice(start, start + _MERGE_ROWS)
        delta = (b[rows].to(compute) @ a) * scaling
        weight[rows] = (weight[rows].to(compute) + delta).to(weight.dtype)


def _numel(param: torch.nn.Parameter) -> int:
    return getattr(param, "ds_numel", param.numel())  # a ZeRO-3 parameter is empty outside a gather


def _full_bytes(param: torch.nn.Parameter) -> int:
    return _numel(param) * param.element_size()


def _base_name(peft_name: str) -> str:
    """peft's module name -> the plain model's (``base_model.model.x.base_layer`` -> ``x``)."""
    return peft_name.removeprefix(_PEFT_PREFIX).replace(".base_layer", "")
