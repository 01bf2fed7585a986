"""Load the policy's tokenizer and model: "builtin:tiny" (built in code) or a local Hugging Face model folder.

Nothing is ever downloaded (``local_files_only=True``). ``check_model_path`` runs the same path checks
without loading anything, so a wrong path is reported before any model is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpo_ds.builtin_tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.errors import UserError, first_line
from grpo_ds.recipe import ModelConfig

BUILTIN_TINY = "builtin:tiny"
# Any one of these makes a folder worth handing to AutoTokenizer. Without them transformers 5 does not fail: it
# silently builds an empty tokenizer of the model type's class (1 token), so we check first.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a recipe dtype name ("float32", "bfloat16", "float16") to the torch dtype."""
    if name not in _DTYPES:
        raise UserError("model.dtype", f"{name!r} is not one of {', '.join(map(repr, _DTYPES))}", "pick one of them")
    return _DTYPES[name]


def check_model_path(model_cfg: ModelConfig) -> None:
    """Raise UserError unless model.path is "builtin:tiny" or a local folder holding a config.json."""
    path = model_cfg.path
    if path == BUILTIN_TINY:
        return
    if path.startswith("builtin:"):
        raise UserError("model.path", f"unknown builtin model {path!r}", f'the only builtin model is "{BUILTIN_TINY}"')
    folder = Path(path)
    if not folder.exists():
        raise UserError("model.path", f"{path} does not exist", f'give a local HF model folder or "{BUILTIN_TINY}"')
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise UserError("model.path", f"{path} is not a Hugging Face model folder (no config.json in it)",
                        f'give the folder that holds config.json and the weights, or "{BUILTIN_TINY}"')


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, padding on the left (generation) and with a pad token (eos if it had none)."""
    check_model_path(model_cfg)
    if model_cfg.path == BUILTIN_TINY:
        return build_tiny_tokenizer()
    if not any((Path(model_cfg.path) / name).is_file() for name in _TOKENIZER_FILES):
        raise UserError("model.path",
                        f"{model_cfg.path} has no tokenizer files (none of {', '.join(_TOKENIZER_FILES)})",
                        "save the tokenizer into the model folder (tokenizer.save_pretrained(folder))")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code,
                                                  local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError("model.path", f"cannot load a tokenizer from {model_cfg.path} ({first_line(err)})",
                        "save the tokenizer into the model folder (tokenizer.save_pretrained(folder))") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError("model.path", f"the tokenizer in {model_cfg.path} has neither a pad nor an eos token",
                            "set pad_token or eos_token in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """The policy model in model.dtype; ``vocab_size`` and ``seed`` only shape the builtin tiny model."""
    check_model_path(model_cfg)
    dtype = torch_dtype(model_cfg.dtype)
    if model_cfg.path == BUILTIN_TINY:
        model = build_tiny_model(vocab_size, model_cfg.tiny_hidden_size, model_cfg.tiny_num_layers,
                                 model_cfg.tiny_num_heads, seed=seed, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype, local_files_only=True,
                                                         trust_remote_code=model_cfg.trust_remote_code)
        except (OSError, ValueError) as err:
            raise UserError("model.path", f"cannot load a causal LM from {model_cfg.path} ({first_line(err)})",
                            "the folder needs config.json and the weights (*.safetensors); set "
                            "model.trust_remote_code=true only if it ships its own modelling code") from None
    if model_cfg.gradient_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated, warns) to activation_checkpointing_enable.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # the KV cache is useless when activations are recomputed
    return model
