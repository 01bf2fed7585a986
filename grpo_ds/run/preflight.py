"""Validation before load: every user input is checked before any model is loaded or any file is
written.

``prepare_inputs`` is the first thing ``grpo_ds.train`` (and the dry run ``grpo_ds.check``) does:
the recipe and its overrides, the DeepSpeed file, the model path, tokenizer and weight files'
headers (grpo_ds.model.weight_files), the reward functions, the reward models' folders
(grpo_ds.model.reward_model_checks), the agent environment, the logging extras and the dataset
rows. A model, reward model or dataset named by a Hugging Face Hub id is fetched into the Hugging
Face cache first, once per node (grpo_ds.run.hub); the dry run fetches no model's weights. What it
returns (``Inputs``) is everything the run needs besides the model. A problem is one ``UserError``
line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_ds.config import software
from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.deepspeed_check import check_precision_supported
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.placement import Placement, resolve_placement
from grpo_ds.config.recipe import Recipe
from grpo_ds.config.reward_specs import RewardModelSpec, reward_specs
from grpo_ds.config.software import resolve_backend
from grpo_ds.envs.loading import load_env_factory
from grpo_ds.errors import UserError
from grpo_ds.model.loading import (
    BUILTIN_TINY,
    check_router_aux_loss,
    check_weights,
    context_length,
    load_tokenizer,
    moe_experts,
)
from grpo_ds.model.reward_model_checks import check_reward_models
from grpo_ds.rewards import RewardFunction, check_columns, load_reward_functions
from grpo_ds.rollout.vllm_checks import check_vllm_setup
from grpo_ds.run import output_paths
from grpo_ds.run.builtin_models import builtin_reward_model
from grpo_ds.run.hub import hub_model
from grpo_ds.run.metrics import check_logging_extras
from grpo_ds.run.prompts import (
    PromptRow,
    data_identity,
    data_source,
    load_rows,
    prepare_prompts,
)


@dataclass
class Inputs:
    recipe: Recipe
    ds_config: dict
    tokenizer: object
    reward_functions: list[RewardFunction]
    prompts: list[PromptRow]
    skipped_rows: int
    kernels_backend: str  # "triton" or "torch", resolved for the device
    # rollout.engine "agent": builds one environment per episode
    env_factory: Callable[[], Any] | None
    eval_prompts: list[PromptRow]  # eval.data's prompts (empty: no evaluation)
    # what data.train holds: source, prompts, fingerprint (grpo_ds.run.prompts.data_identity)
    data_identity: dict
    placement: Placement  # which ranks train and which generate (rollout.placement)
    # rank 0's reward worker processes (grpo_ds.rewards.pool), started by the driver
    reward_pool: Any = None
    reward_models: tuple[RewardModelSpec, ...] = ()  # reward.models, parsed, their folders checked


def prepare_inputs(
    recipe: str | Path | dict | Recipe,
    overrides: list[str] | dict | None,
    world_size: int,
    device_type: str,
    machine: bool = True,
) -> Inputs:
    """Check everything the user controls; raise UserError on the first problem. Loads no model.
    ``machine`` False (the dry run, which may plan a GPU run on another machine) skips what only the
    machine the run uses can tell: GPUs and an importable vLLM; and it fetches no weights of a model
    named by a Hub id (its config and tokenizer only), so their files go unchecked."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    # first: every later check reads the model's folder (a download is kept in the cache)
    recipe = _model_from_hub(recipe, weights=machine)
    placement, ds_config = _check_setup(recipe, world_size, device_type, machine)
    backend = _kernels_backend(recipe.kernels.backend, device_type)
    tokenizer = load_tokenizer(recipe.model)  # checks model.path first
    if machine or recipe.model_hub_id is None:
        check_weights(recipe.model)  # complete weight files (the policy's and the reference's)
    check_router_aux_loss(recipe.model)  # an MoE's load-balancing loss: refused for a dense model
    _check_tensor_parallel(recipe)
    rewards = reward_specs(recipe.reward)  # parsed when the recipe was loaded
    reward_functions = load_reward_functions(rewards.functions)
    reward_models, from_hub = _reward_model_folders(rewards.models, weights=machine)
    # their folders, heads, weights (not fetched from the Hub by the dry run), tokenizers, lengths
    check_reward_models(reward_models, unfetched_weights=() if machine else from_hub)
    check_logging_extras(recipe.logging)
    env_factory = (
        load_env_factory(recipe.rollout.env, recipe.rollout.env_options)
        if recipe.rollout.engine == "agent"
        else None
    )
    prompts, skipped = prepare_prompts(
        load_rows(recipe.data, recipe.source_dir),
        recipe.data,
        tokenizer,
        where=f"data.train {recipe.data.train}",
    )
    check_columns({key for row in prompts for key in row.columns})
    eval_prompts = _eval_prompts(recipe, tokenizer)
    _check_context_length(recipe, prompts, eval_prompts)
    identity = data_identity(data_source(recipe.data, recipe.source_dir), prompts)
    return Inputs(
        recipe,
        ds_config,
        tokenizer,
        reward_functions,
        prompts,
        skipped,
        backend,
        env_factory,
        eval_prompts,
        identity,
        placement,
        reward_models=reward_models,
    )


def _model_from_hub(recipe: Recipe, weights: bool) -> Recipe:
    """The recipe with a Hub id in model.path replaced by its folder in the Hugging Face cache,
    fetched once per node (without ``weights``: its config and tokenizer only), which every reader
    of model.path then reads; ``Recipe.to_dict`` writes the id back."""
    if recipe.model_hub_id is not None:  # resolved already
        return recipe
    m = recipe.model
    folder = hub_model("model.path", m.path, m.revision, "model.revision", weights)
    if folder is None:
        return recipe
    model = dataclasses.replace(m, path=str(folder))
    return dataclasses.replace(recipe, model=model, model_hub_id=m.path)


def _reward_model_folders(
    specs: tuple[RewardModelSpec, ...], weights: bool
) -> tuple[tuple[RewardModelSpec, ...], tuple[int, ...]]:
    """The reward models with each ``builtin:`` path replaced by the folder it names, written on
    first use (grpo_ds.run.builtin_models.builtin_reward_model), and each Hub id by its folder in
    the Hugging Face cache (without ``weights``: config and tokenizer only); the recipe keeps the
    names. Also: the indices of the models fetched from the Hub."""
    resolved, from_hub = [], []
    for i, spec in enumerate(specs):
        where = f"reward.models[{i}]"
        folder = builtin_reward_model(f"{where}.path", spec.path)
        if folder is None:
            folder = hub_model(
                f"{where}.path", spec.path, spec.revision, f"{where}.revision", weights
            )
            from_hub += [i] if folder is not None else []
        resolved.append(spec if folder is None else dataclasses.replace(spec, path=str(folder)))
    # none resolved: the parsed specs themselves, which every reader shares
    same = all(a is b for a, b in zip(resolved, specs, strict=True))
    return (specs if same else tuple(resolved)), tuple(from_hub)


def _check_setup(
    recipe: Recipe, world_size: int, device_type: str, machine: bool
) -> tuple[Placement, dict]:
    """The recipe against this job: its output folders, the installed software, the ranks' roles,
    vLLM's setup and the DeepSpeed config. Returns the placement and the resolved DeepSpeed
    config."""
    # every folder the run writes in: writable, or one that can be created
    output_paths.inspect(recipe)
    # installed versions: the minimums, vLLM's range and torch, peft (model.lora_rank)
    software.check(recipe)
    # split: the last rollout.ranks ranks only generate
    placement = resolve_placement(recipe, world_size)
    generating = placement.rollout_ranks if placement.split else world_size
    # rollout.engine "vllm": TP size, GPUs, vLLM
    check_vllm_setup(recipe, generating, device_type, machine)
    # the trainer's world
    ds_config = resolve_deepspeed_config(recipe, placement.trainer_ranks, device_type)
    if machine:
        # model.dtype float16 on a CPU without fp16 kernels
        check_precision_supported(ds_config, device_type)
    return placement, ds_config


def _eval_prompts(recipe: Recipe, tokenizer) -> list[PromptRow]:
    if recipe.eval.data is None:
        return []
    e = recipe.eval
    # eval.data read as data.train is, with eval's Hub keys; messages name eval's keys (below)
    cfg = dataclasses.replace(
        recipe.data,
        train=e.data,
        train_config=e.data_config,
        train_split=e.data_split,
        train_revision=e.data_revision,
    )
    try:
        prompts, _ = prepare_prompts(
            load_rows(cfg, recipe.source_dir), cfg, tokenizer, where=f"eval.data {recipe.eval.data}"
        )
    except UserError as err:
        raise UserError(err.where.replace("data.train", "eval.data"), err.what, err.fix) from None
    return prompts[: recipe.eval.max_prompts] if recipe.eval.max_prompts else prompts


def _check_context_length(
    recipe: Recipe, prompts: list[PromptRow], eval_prompts: list[PromptRow]
) -> None:
    """The longest prompt kept (data.train and eval.data) plus the response budget must fit the
    model's context length, read from its config before any weight loads. The prompts themselves are
    known here, so the check is on the longest one rather than on data.max_prompt_tokens (a filter,
    often left at its default); vLLM plans for rollout.vllm_max_model_len (default:
    data.max_prompt_tokens + max_new_tokens) and refuses one past the model's."""
    found = context_length(recipe.model)
    if found is None:
        return
    limit, source = found
    r = recipe.rollout
    if recipe.uses_vllm:
        planned = r.vllm_max_model_len or recipe.data.max_prompt_tokens + recipe.max_response_tokens
        if planned > limit:
            budget = (
                "rollout.max_total_tokens"
                if r.engine == "agent" and r.max_total_tokens
                else "rollout.max_new_tokens"
            )
            key = (
                "rollout.vllm_max_model_len"
                if r.vllm_max_model_len
                else f"data.max_prompt_tokens + {budget}"
            )
            raise UserError(
                key,
                f"{planned} is more than the model's context length {limit} ({source}), which vLLM "
                "refuses",
                f"plan for at most {limit} tokens",
            )
    key = (
        "rollout.max_total_tokens"
        if r.engine == "agent" and r.max_total_tokens
        else "rollout.max_new_tokens"
    )
    response = recipe.max_response_tokens
    source_key, row = max(
        [("data.train", p) for p in prompts] + [("eval.data", p) for p in eval_prompts],
        key=lambda item: len(item[1].prompt_ids),
    )
    prompt = len(row.prompt_ids)
    if prompt + response > limit:
        fix = f"lower {key} to at most {limit - prompt}, or " if prompt < limit else ""
        raise UserError(
            key,
            f"the longest prompt ({prompt} tokens, {source_key} row {row.index + 1}) + {response} "
            f"response tokens = {prompt + response} is more than the model's context length "
            f"{limit} ({source})",
            fix + 'leave out long prompts with data.max_prompt_tokens and data.on_bad_row="skip"',
        )


def _kernels_backend(requested: str, device_type: str) -> str:
    try:
        return resolve_backend(requested, device_type)
    except ValueError as err:
        raise UserError(
            f"kernels.backend {requested!r}", str(err), 'Set kernels.backend to "auto" or "torch"'
        ) from None


def _check_tensor_parallel(recipe: Recipe) -> None:
    """Every rank of a tensor- or sequence-parallel group must hold whole attention heads (read from
    the model's config; the builtin model's heads are checked with the recipe). Ulysses also needs
    sdpa or flash attention. AutoTP cannot split a mixture of experts."""
    m = recipe.model
    tp = recipe.train.tensor_parallel_size
    if tp > 1 and moe_experts(m):
        raise UserError(
            "train.tensor_parallel_size",
            f"{tp} with a mixture-of-experts model ({m.path}): DeepSpeed's "
            "AutoTP rejects transformers' fused expert tensors (tp_plan styles moe_tp_experts, "
            "packed_colwise)",
            "use tensor_parallel_size 1 (ZeRO-3 partitions the experts over the ranks)",
        )
    sizes = {
        "train.tensor_parallel_size": recipe.train.tensor_parallel_size,
        "train.sequence_parallel_size": recipe.train.sequence_parallel_size,
    }
    if all(size == 1 for size in sizes.values()) or m.path == BUILTIN_TINY:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        m.path, trust_remote_code=m.trust_remote_code, local_files_only=True
    )
    heads = getattr(config, "num_attention_heads", None)
    for key, size in sizes.items():
        if heads is not None and heads % size:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise UserError(
                key,
                f"{size} does not divide the model's {heads} attention heads "
                f"({m.path}/config.json)",
                f"use one of {', '.join(map(str, fits))}",
            )
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if sizes["train.sequence_parallel_size"] > 1 and attention == "eager":
        raise UserError(
            "train.sequence_parallel_size",
            f"{m.path} asks for eager attention, which DeepSpeed's Ulysses cannot wrap",
            'set "attn_implementation": "sdpa" in its config.json',
        )
