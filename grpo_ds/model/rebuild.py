"""The trained model rebuilt for the export (grpo_ds.export) from the run's recipe and a
consolidated fp32 state dict (grpo_ds.run.consolidate): nothing is downloaded.

``build_model`` makes the skeleton as training built it (builtin:tiny, or the local folder's
config), ``load_strict`` loads every weight (a tied one DeepSpeed stored once is filled from its
twin), ``lora_model`` puts a LoRA run's adapters on its base model, and ``generation_config`` is
the one the exported folder carries.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.initialization import no_init_weights

from grpo_ds.config.recipe import ModelConfig
from grpo_ds.errors import UserError, first_line
from grpo_ds.model import lora
from grpo_ds.model.loading import BUILTIN_TINY, load_model
from grpo_ds.model.tiny import build_tiny_model, tiny_shape


def build_model(model_cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """The model's skeleton in fp32, as training built it; weights are left uninitialised (all are
    loaded)."""
    if model_cfg.path == BUILTIN_TINY:
        return build_tiny_model(vocab_size, dtype=torch.float32, **tiny_shape(model_cfg))
    try:
        config = AutoConfig.from_pretrained(
            model_cfg.path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as err:
        raise UserError(
            "model.path",
            f"cannot read the model config in {model_cfg.path} ({first_line(err)})",
            "restore the model folder training used",
        ) from None
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=model_cfg.trust_remote_code, dtype=torch.float32
        )
    # no_init_weights skips tying too; a tied lm_head must share the embedding again
    model.tie_weights()
    return model


def load_strict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """``load_state_dict(strict=True)``, except that a tied weight DeepSpeed stored once is filled
    from its twin."""
    expected = model.state_dict()
    by_storage: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    for name in [n for n in expected if n not in state_dict]:
        twin = next((t for t in by_storage[expected[name].data_ptr()] if t in state_dict), None)
        if twin is not None:
            state_dict[name] = state_dict[twin]
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = sorted(
        n for n in set(expected) & set(state_dict) if expected[n].shape != state_dict[n].shape
    )
    if missing or unexpected or wrong_shape:
        names = _listed(
            ("missing", missing), ("unexpected", unexpected), ("different shape", wrong_shape)
        )
        raise UserError(
            str(folder),
            f"its weights do not fit the model in recipe.json: {names}",
            "export with the recipe.json and model folder the run was trained with",
        )
    model.load_state_dict(state_dict, strict=True)


def lora_model(
    model_cfg: ModelConfig,
    seed: int,
    vocab_size: int,
    adapters: dict[str, torch.Tensor],
    folder: Path,
) -> torch.nn.Module:
    """The base model as training loaded it, in fp32, with the checkpoint's adapters on it (a peft
    model)."""
    model = lora.apply_lora(load_model(model_cfg, vocab_size, seed).float(), model_cfg)
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(expected - set(adapters)), sorted(set(adapters) - expected)
    if missing or unexpected:
        names = _listed(("missing", missing), ("unexpected", unexpected))
        raise UserError(
            str(folder),
            f"its adapters do not fit the LoRA settings in recipe.json: {names}",
            "export with the recipe.json the run was trained with",
        )
    model.load_state_dict(adapters, strict=False)
    return model


def generation_config(model_cfg: ModelConfig, model, tokenizer):
    """The model folder's generation_config.json when it has one; else one with the tokenizer's
    eos/pad ids."""
    if (
        model_cfg.path != BUILTIN_TINY
        and (Path(model_cfg.path) / "generation_config.json").is_file()
    ):
        return GenerationConfig.from_pretrained(model_cfg.path, local_files_only=True)
    config = GenerationConfig.from_model_config(model.config)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    if model_cfg.path == BUILTIN_TINY:
        config.bos_token_id = None  # the tiny tokenizer adds no BOS
    return config


def _listed(*groups: tuple[str, list[str]]) -> str:
    """Each group that holds names, with its first three and its count, such as ``missing a, b,
    c ... (7); unexpected d (1)``."""
    return "; ".join(
        f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)})"
        for label, names in groups
        if names
    )
