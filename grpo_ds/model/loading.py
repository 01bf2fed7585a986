"""Load the policy's tokenizer and model: "builtin:tiny" (built in code) or a local Hugging Face
model folder.

Nothing is downloaded here (``local_files_only=True``): a model named by a Hugging Face Hub id has
been fetched into the Hugging Face cache before (grpo_ds.run.hub), and ``model.path`` holds its
folder there. ``check_model_path`` runs the same path checks without loading anything, so a wrong
path is reported before any model is loaded; ``check_weights`` reads the weight files' headers
(grpo_ds.model.weight_files), so a file cut short or of another format is too.

Partitioned loading. Given a ZeRO-3 DeepSpeed config, ``load_model`` loads with transformers'
DeepSpeed integration alive (an ``HfDeepSpeedConfig`` of the resolved config, kept for the duration
of the load only): the model is built inside ``deepspeed.zero.Init``, rank 0 reads the weights and
each module's are scattered as it loads, so every rank holds 1/dp of every weight from the start and
no rank holds the whole model. ``builtin:tiny`` goes the same way: rank 0 builds the seeded model
(tiny) and its weights are scattered into the partitioned skeleton, so the initial weights are the
same on every rank and at every world size (a bare ``zero.Init`` around the constructor would
initialise empty partitions). Outside ZeRO-3 transformers loads on the meta device first and then
reads the weights (no random initialisation, no second copy).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_ds.config.deepspeed_keys import zero_stage
from grpo_ds.config.dtypes import DTYPES
from grpo_ds.config.parse import printable, read_json_object
from grpo_ds.config.recipe import ModelConfig
from grpo_ds.errors import UserError, first_line
from grpo_ds.model.tiny import (
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
    tiny_model_class,
    tiny_shape,
)
from grpo_ds.model.weight_files import FILE_ERRORS, FIX, check_model_weights, model_weights_problem

BUILTIN_TINY = "builtin:tiny"
# Any one of these makes a folder worth handing to AutoTokenizer. Without them transformers 5 does
# not fail: it silently builds an empty tokenizer of the model type's class (1 token), so we check
# first.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
# Config keys that count the experts of an MoE layer (Qwen2/3-MoE and OLMoE; Mixtral and
# transformers 5's Qwen3-MoE; DeepSeek-V3)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# Config keys that bound the sequence length, as vLLM reads them (the smallest present wins).
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "n_ctx",
)


def torch_dtype(name: str) -> torch.dtype:
    """Map a recipe dtype name ("float32", "bfloat16", "float16") to the torch dtype."""
    if name not in DTYPES:
        raise UserError(
            "model.dtype",
            f"{name!r} is not one of {', '.join(map(repr, DTYPES))}",
            "pick one of them",
        )
    return getattr(torch, name)


def check_model_path(model_cfg: ModelConfig) -> None:
    """Raise UserError unless model.path is "builtin:tiny" or a local folder holding a
    config.json."""
    path = model_cfg.path
    if path == BUILTIN_TINY:
        return
    if path.startswith("builtin:"):
        raise UserError(
            "model.path",
            f"unknown builtin model {path!r}",
            f'the only builtin model is "{BUILTIN_TINY}"',
        )
    folder = Path(path)
    if not folder.exists():
        raise UserError(
            "model.path",
            f"{printable(path)} does not exist",
            f'give a local HF model folder, a Hugging Face Hub id (owner/name) or "{BUILTIN_TINY}"',
        )
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise UserError(
            "model.path",
            f"{printable(path)} is not a Hugging Face model folder (no config.json in it)",
            f'give the folder that holds config.json and the weights, or "{BUILTIN_TINY}"',
        )


def check_weights(model_cfg: ModelConfig) -> None:
    """Raise UserError unless the policy's weight files (which the reference model loads too) are
    there and complete, read from their headers alone; builtin:tiny has none."""
    check_model_path(model_cfg)
    if model_cfg.path != BUILTIN_TINY:
        check_model_weights("model.path", Path(model_cfg.path))


def context_length(model_cfg: ModelConfig) -> tuple[int, str] | None:
    """The longest sequence (prompt + completion) the model takes and where that was read, from its
    config.json alone (no weights); None when the config names no length. A RoPE scaling that
    stretches the window (linear, dynamic, yarn) multiplies it by its factor, as vLLM counts it."""
    check_model_path(model_cfg)
    if model_cfg.path == BUILTIN_TINY:
        length = tiny_config(vocab_size=len(SPECIAL_TOKENS)).max_position_embeddings
        return length, "max_position_embeddings of builtin:tiny"
    path = Path(model_cfg.path) / "config.json"
    config = _language_config(model_cfg)
    found = [
        (config[key], key)
        for key in _CONTEXT_KEYS
        if isinstance(config.get(key), int)
        and not isinstance(config[key], bool)
        and config[key] > 0
    ]
    if not found:
        return None
    length, key = min(found)
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    factor = rope.get("factor") if isinstance(rope, dict) else None
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("linear", "dynamic", "yarn") and isinstance(factor, (int, float)) and factor > 1:
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        length = int((base if isinstance(base, int) and base > 0 else length) * factor)
        key += f" with {kind} RoPE scaling x{factor}"
    return length, f"{key} in {path}"


def _language_config(model_cfg: ModelConfig) -> dict:
    """A model folder's config.json as a dict (a multimodal model's: its language model's part)."""
    config = read_json_object(
        Path(model_cfg.path) / "config.json", "a model config", '{"model_type": "llama", ...}'
    )
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def moe_experts(model_cfg: ModelConfig) -> int:
    """The experts of each mixture-of-experts layer, from the config alone (no weights); 0 for a
    dense model."""
    check_model_path(model_cfg)
    if model_cfg.path == BUILTIN_TINY:
        return model_cfg.tiny_num_experts
    config = _language_config(model_cfg)
    return next(
        (config[k] for k in _EXPERT_KEYS if isinstance(config.get(k), int) and config[k] > 0), 0
    )


def check_router_aux_loss(model_cfg: ModelConfig) -> None:
    """model.router_aux_loss_coef > 0 needs routers with transformers' load-balancing loss (a config
    that has router_aux_loss_coef: Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS; not a dense model, nor
    DeepSeek-V3's bias-balanced routers). Checked before any weight loads."""
    coef = model_cfg.router_aux_loss_coef
    if coef == 0:
        return
    where = "builtin:tiny" if model_cfg.path == BUILTIN_TINY else f"{model_cfg.path}/config.json"
    if not moe_experts(model_cfg):
        fix = (
            "set model.tiny_num_experts for a builtin mixture of experts"
            if model_cfg.path == BUILTIN_TINY
            else "it applies to mixture-of-experts models only"
        )
        raise UserError(
            "model.router_aux_loss_coef",
            f"{coef} for a dense model ({where} has no experts)",
            f"set it to 0, or {fix}",
        )
    if model_cfg.path != BUILTIN_TINY and "router_aux_loss_coef" not in _language_config(model_cfg):
        raise UserError(
            "model.router_aux_loss_coef",
            f"{coef}, but the routers of {where} have no load-balancing "
            "loss in transformers (no router_aux_loss_coef in the config)",
            "set it to 0",
        )


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, padding on the left (generation) and with a pad token (eos if it had
    none)."""
    check_model_path(model_cfg)
    if model_cfg.path == BUILTIN_TINY:
        return build_tiny_tokenizer()
    if not any((Path(model_cfg.path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            "model.path",
            f"{model_cfg.path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})",
            "save the tokenizer into the model folder (tokenizer.save_pretrained(folder))",
        )
    try:
        tokenizer = load_saved_tokenizer(model_cfg.path, model_cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(
            "model.path",
            f"cannot load a tokenizer from {model_cfg.path} ({first_line(err)})",
            "save the tokenizer into the model folder (tokenizer.save_pretrained(folder))",
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                "model.path",
                f"the tokenizer in {model_cfg.path} has neither a pad nor an eos token",
                "set pad_token or eos_token in its tokenizer_config.json",
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_saved_tokenizer(
    folder: str | Path, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``folder`` (local files only), of the class its tokenizer_config.json
    names. The policy's, the reference model's and every reward model's tokenizer load here.

    transformers' AutoTokenizer (checked on 5.24.0) loads the class of config.json's model_type
    instead of the saved one when that type is on its list of hub models with a wrong tokenizer
    class (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: qwen2, phi3 and others). Qwen2Tokenizer
    rebuilds the saved vocabulary with its own normalizer, pre-tokenizer and decoder, so a Qwen2
    model saved with another tokenizer reads other token ids, with no error. A config without a
    model type skips that override; the saved class name is then resolved as AutoTokenizer resolves
    any (tests/model/test_loading.py pins both). A folder that names no class, or one with remote
    code (auto_map), loads as AutoTokenizer loads it: its model type is the only hint."""
    folder = Path(folder)
    kwargs: dict = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    saved = folder / "tokenizer_config.json"
    if saved.is_file():
        config = read_json_object(saved, "tokenizer_config.json", '{"tokenizer_class": "..."}')
        if config.get("tokenizer_class") and "auto_map" not in config:
            kwargs["config"] = PreTrainedConfig(name_or_path=str(folder))
    return AutoTokenizer.from_pretrained(folder, **kwargs)


def load_model(
    model_cfg: ModelConfig, vocab_size: int, seed: int, ds_config: dict | None = None
) -> PreTrainedModel:
    """The policy model in model.dtype; ``vocab_size`` and ``seed`` only shape the builtin tiny
    model. With a ZeRO-3 ``ds_config`` the model is born partitioned (see the module docstring). The
    caller's RNG stream is untouched."""
    check_model_path(model_cfg)
    dtype = torch_dtype(model_cfg.dtype)
    with torch.random.fork_rng(devices=[]), partitioned_loading(ds_config) as partitioned:
        if model_cfg.path == BUILTIN_TINY:
            model = (
                _tiny_partitioned(model_cfg, vocab_size, seed, dtype)
                if partitioned
                else build_tiny_model(vocab_size, seed=seed, dtype=dtype, **tiny_shape(model_cfg))
            )
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    model_cfg.path,
                    dtype=dtype,
                    local_files_only=True,
                    trust_remote_code=model_cfg.trust_remote_code,
                )
            except (ValueError, *FILE_ERRORS) as err:
                # a file damaged since the pre-load check (check_weights) is named; else the error
                if problem := model_weights_problem(Path(model_cfg.path)):
                    raise UserError("model.path", problem, FIX) from None
                raise UserError(
                    "model.path",
                    f"cannot load a causal LM from {model_cfg.path} ({first_line(err)})",
                    "the folder needs config.json and the weights (*.safetensors); set "
                    "model.trust_remote_code=true only if it ships its own modelling code",
                ) from None
    # the saved model says what it was trained with (the loss reads
    if hasattr(model.config, "router_aux_loss_coef"):
        # the recipe: grpo_ds.step.loss)
        model.config.router_aux_loss_coef = model_cfg.router_aux_loss_coef
    if model_cfg.gradient_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated, warns) to
        # activation_checkpointing_enable.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.config.use_cache = False  # the KV cache is useless when activations are recomputed
    return model


def is_partitioned(ds_config: dict | None) -> bool:
    """Whether models load partitioned under ``ds_config``: ZeRO stage 3 without tensor parallelism
    (AutoTP splits whole layers when the engine is built, so under it every rank loads the whole
    model on the host first)."""
    if ds_config is None:
        return False
    tp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1)
    return zero_stage(ds_config) == 3 and tp in (0, 1)


@contextmanager
def partitioned_loading(ds_config: dict | None):
    """transformers' DeepSpeed integration alive for the duration (ZeRO-3 only). It is not kept
    beyond the load: while it is alive transformers' ``generate`` syncs every rank at every token
    (``synced_gpus``), which the rollout engines' unsharded copies must not do."""
    if not is_partitioned(ds_config):
        yield False
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    # zero.Init reads only the ZeRO and precision settings, but checks the batch keys against the
    # world size, which a sequence-parallel run's train_batch_size (counted over the data-parallel
    # ranks) does not fit: leave it out.
    # held while loading
    alive = HfDeepSpeedConfig({k: v for k, v in ds_config.items() if k != "train_batch_size"})
    try:
        yield True
    finally:
        unset_hf_deepspeed_config()
        del alive


def _tiny_partitioned(
    model_cfg: ModelConfig, vocab_size: int, seed: int, dtype: torch.dtype
) -> PreTrainedModel:
    """builtin:tiny inside zero.Init, its seeded weights built on rank 0 and scattered module by
    module."""
    import deepspeed
    from transformers.initialization import no_init_weights

    config = tiny_config(vocab_size, **tiny_shape(model_cfg))
    with no_init_weights():  # every weight is overwritten below
        model = tiny_model_class(config)._from_config(config, dtype=dtype)
    main = torch.distributed.get_rank() == 0
    source = (
        dict(
            build_tiny_model(
                vocab_size, seed=seed, dtype=dtype, **tiny_shape(model_cfg)
            ).named_parameters()
        )
        if main
        else {}
    )
    for prefix, module in model.named_modules():
        params = dict(module.named_parameters(prefix=prefix, recurse=False))
        if not params:
            continue
        with (
            deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0),
            torch.no_grad(),
        ):
            if main:
                for name, param in params.items():
                    param.copy_(source[name])
    return model
