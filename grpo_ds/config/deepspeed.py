"""Resolve a plain DeepSpeed JSON file against a recipe and a world size.

The recipe owns the batch algebra; the DeepSpeed file owns ZeRO settings. Keys the recipe derives
are written as "auto" in ``ds_configs/*.json`` and filled here:

    train_micro_batch_size_per_gpu = train.micro_batch_samples_per_gpu
    gradient_accumulation_steps    = micro-batches per rank per optimizer step (static plan:
                                     ceil(ceil(samples_per_optimizer_step / dp) / micro))
    train_batch_size               = micro x gradient_accumulation_steps x world_size
    tensor_parallel.autotp_size    = train.tensor_parallel_size (tp > 1 only)

One rank: a stage-3 file without offload runs as stage 1 (``one_rank_stage``), unless
train.zero3_on_one_rank. ZeRO-3 on one rank partitions nothing, yet gathers and releases every
module's parameters around each forward and backward; stage 1 holds the same fp32 master weights,
gradients and optimizer states on that rank without those hooks. Offload keeps stage 3 (parameter
offload exists only there); so do two or more ranks. Wherever every rank holds the whole module
(ZeRO 0-2, no tensor or sequence parallelism), the hf and agent engines generate with it
(``rollout_shares_policy``): no second copy, no weight sync.

dp = world size / tp / sp. With Ulysses sequence parallelism DeepSpeed gets the sequence-parallel
groups (mpu) and counts ``train_batch_size`` over dp. With tensor parallelism DeepSpeed checks
``train_batch_size`` twice: once against the world size (its top-level config counts the TP ranks)
and, under ZeRO-3, once against dp (the partitioner re-reads the config with the TP groups). No
number satisfies both under ZeRO-3, so there the key is left out (DeepSpeed then derives it from
micro and accumulation); under ZeRO 0-2 it is micro x accumulation x world. AutoTP keeps a tied
lm_head whole (``vocab_parallel_lm_head`` false): the loss needs every rank's logits over the whole
vocabulary.

A number in the file that contradicts the derived value is an error naming the number to change.
The driver owns the optimizer-step boundary: ``managed_gradient_accumulation`` is false and
``backward`` is called with ``scale_wrt_gas=False``, so a step may run any number of
micro-batches (padding, dynamic batching) with exact loss scaling (see grpo_ds.step.loss).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from pathlib import Path
from typing import Any

from grpo_ds.config.deepspeed_check import (
    check_deepspeed_config,
    check_shapes,
    choose_accelerator,
    scheduler_class,
)
from grpo_ds.config.deepspeed_keys import offloaded, zero_stage
from grpo_ds.config.dtypes import DEEPSPEED_SECTIONS
from grpo_ds.config.parse import check_finite, printable, read_json_object
from grpo_ds.config.recipe import Recipe
from grpo_ds.errors import UserError

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # ds_configs/ sits beside grpo_ds/ in the repo


def find_deepspeed_file(spec: str, source_dir: str) -> Path:
    """Look for a DeepSpeed JSON path in the working directory, the recipe's folder, then the repo
    root."""
    path = Path(spec)
    candidates = (
        [path] if path.is_absolute() else [path, Path(source_dir) / path, _PACKAGE_ROOT / path]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UserError(
        "deepspeed",
        f"{printable(spec)} not found (looked in the working directory, the recipe's "
        f"folder and {_PACKAGE_ROOT})",
        "give a path to a DeepSpeed JSON file, e.g. ds_configs/zero3.json",
    )


def load_deepspeed_json(recipe: Recipe) -> tuple[dict, str]:
    """Return (raw DeepSpeed dict, where-string for messages)."""
    if isinstance(recipe.deepspeed, dict):
        return copy.deepcopy(recipe.deepspeed), "deepspeed"
    path = find_deepspeed_file(recipe.deepspeed, recipe.source_dir)
    return read_json_object(path, "a DeepSpeed config", '{"zero_optimization": {...}}'), str(path)


def static_micro_batches_per_rank(samples: int, world_size: int, micro_samples: int) -> int:
    """Micro-batches each rank runs for `samples` samples with count-balanced shards (the largest
    shard decides)."""
    return max(1, math.ceil(math.ceil(samples / world_size) / micro_samples))


def resolve_deepspeed_config(
    recipe: Recipe, world_size: int, device_type: str = "cpu"
) -> dict[str, Any]:
    """The DeepSpeed config grpo_ds passes to deepspeed.initialize (and writes into the run
    folder)."""
    choose_accelerator(device_type)  # before anything below imports DeepSpeed
    raw, where = load_deepspeed_json(recipe)
    check_finite(f"{where}:", raw)
    check_shapes(raw, where)
    tp = _tensor_parallel_size(recipe, raw, world_size, where)
    sp = recipe.train.sequence_parallel_size
    dp = world_size // tp // sp
    gas = static_micro_batches_per_rank(
        recipe.samples_per_optimizer_step, dp, recipe.train.micro_batch_samples_per_gpu
    )
    raw = one_rank_stage(raw, recipe, world_size)
    zero = raw.get("zero_optimization")
    zero3 = isinstance(zero, dict) and zero.get("stage", 0) == 3
    if sp > 1:
        _check_sequence_parallel(sp, tp, world_size, zero3, where)
    derived = _derived_keys(recipe, world_size, tp, dp, gas)
    out = copy.deepcopy(raw)
    # see the module docstring: no train_batch_size satisfies DeepSpeed under AutoTP + ZeRO-3
    if tp > 1 and zero3:
        del derived["train_batch_size"]
        if out.pop("train_batch_size", "auto") != "auto":
            raise UserError(
                f"{where}: train_batch_size",
                "cannot be given with tensor parallelism under ZeRO-3 "
                "(DeepSpeed checks it against two different sizes)",
                'set it to "auto" or remove it',
            )
    for key, (value, origin) in derived.items():
        _fill(out, key.split("."), value, origin, where)
    dtype = recipe.model.dtype
    for name, section in DEEPSPEED_SECTIONS.items():
        _fill(out, [section, "enabled"], dtype == name, f"model.dtype {dtype!r}", where)
    _resolve_lean_bf16(out, recipe, where)
    _resolve_optimizer(out, recipe, device_type, where)
    _resolve_scheduler(out, recipe, where)
    out.setdefault("steps_per_print", 10**9)  # grpo_ds prints its own metrics
    out.setdefault("wall_clock_breakdown", False)
    leftover = _find_auto(out)
    if leftover:
        raise UserError(
            f"{where}: {leftover}", '"auto" is not a value grpo_ds can derive', "give a number"
        )
    # what DeepSpeed itself would reject, before any engine
    check_deepspeed_config(out, where, dtype, device_type)
    return out


def _derived_keys(
    recipe: Recipe, world_size: int, tp: int, dp: int, gas: int
) -> dict[str, tuple[Any, str]]:
    """The keys the recipe derives ("dotted.key" -> (value, where it comes from)): the batch
    algebra, the clipping, the step boundary grpo_ds owns, and AutoTP's size (tp > 1)."""
    train, micro = recipe.train, recipe.train.micro_batch_samples_per_gpu
    sp = train.sequence_parallel_size
    # with Ulysses' groups DeepSpeed counts data-parallel ranks
    batch_ranks = dp if sp > 1 else world_size
    derived = {
        "train_micro_batch_size_per_gpu": (micro, "train.micro_batch_samples_per_gpu"),
        "gradient_accumulation_steps": (
            gas,
            f"ceil(ceil(samples_per_optimizer_step {recipe.samples_per_optimizer_step}"
            f" / data-parallel size {dp}) / micro {micro})",
        ),
        "train_batch_size": (
            micro * gas * batch_ranks,
            f"micro {micro} x gradient accumulation {gas} x "
            + (f"data-parallel size {dp}" if sp > 1 else f"world size {world_size}"),
        ),
        "gradient_clipping": (train.max_grad_norm, "train.max_grad_norm"),
        "managed_gradient_accumulation": (False, "grpo_ds owns the optimizer-step boundary"),
    }
    if tp > 1:
        derived["tensor_parallel.autotp_size"] = (tp, "train.tensor_parallel_size")
        derived["tensor_parallel.vocab_parallel_lm_head"] = (
            False,
            "the loss needs the logits over the whole vocabulary on every rank",
        )
    return derived


def one_rank_stage(raw: dict, recipe: Recipe, world_size: int) -> dict:
    """``raw`` with ZeRO stage 1 in place of stage 3 when one rank trains without offload (see the
    module docstring); otherwise ``raw`` itself. The stage-3-only keys go with the stage, and so
    does overlap_comm."""
    zero = raw.get("zero_optimization")
    if (
        world_size != 1
        or recipe.train.zero3_on_one_rank
        or not isinstance(zero, dict)
        or zero.get("stage") != 3
    ):
        return raw
    if offloaded(zero, "offload_param") or offloaded(zero, "offload_optimizer"):
        return raw
    kept = {
        k: v
        for k, v in zero.items()
        if not k.startswith("stage3_") and k not in ("offload_param", "stage")
    }
    # overlap_comm overlaps the gradient reduction with the backward: one rank reduces nothing, and
    # DeepSpeed refuses it under stage 1 when grpo_ds owns the accumulation boundary
    # (managed_gradient_accumulation false)
    return {**raw, "zero_optimization": {"stage": 1, **kept, "overlap_comm": False}}


def one_rank_stage_note(recipe: Recipe, ds_config: dict) -> str | None:
    """The one-line note when ``one_rank_stage`` changed the file's stage (None when it did not)."""
    raw, where = load_deepspeed_json(recipe)
    file_stage = (
        (raw.get("zero_optimization") or {}).get("stage") if isinstance(raw, dict) else None
    )
    if file_stage != 3 or zero_stage(ds_config) != 1:
        return None
    return (
        f"{where}: ZeRO stage 3 runs as stage 1 on one rank (no more memory, without ZeRO-3's "
        "per-module gathers); train.zero3_on_one_rank=true keeps stage 3"
    )


def rollout_shares_policy(recipe: Recipe, ds_config: dict) -> bool:
    """Whether the hf and agent engines generate with the policy's own module instead of an
    unsharded copy of it: when every rank holds that module whole (ZeRO stage 0-2, no tensor or
    sequence parallelism). The copy would hold the same values after each weight sync; sharing saves
    its memory and the sync. Under LoRA the shared module is the peft model, which adds each
    adapter's product to its layer's output as the trainer does, instead of a copy with the adapters
    merged into the weights (the same function, rounded differently)."""
    t = recipe.train
    return (
        not recipe.uses_vllm
        and zero_stage(ds_config) < 3
        and t.tensor_parallel_size == 1
        and t.sequence_parallel_size == 1
    )


def _tensor_parallel_size(recipe: Recipe, raw: dict, world_size: int, where: str) -> int:
    """train.tensor_parallel_size, checked against the world size and against an autotp_size in the
    file."""
    tp = recipe.train.tensor_parallel_size
    section = raw.get("tensor_parallel")
    in_file = section.get("autotp_size", "auto") if isinstance(section, dict) else "auto"
    if in_file not in ("auto", 0, 1, tp):
        raise UserError(
            f"{where}: tensor_parallel.autotp_size",
            f"is {json.dumps(in_file)} but train.tensor_parallel_size is {tp}",
            'set it to "auto" and choose the size in the recipe (train.tensor_parallel_size)',
        )
    if world_size % tp:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UserError(
            "train.tensor_parallel_size",
            f"{tp} does not divide the world size {world_size}",
            f"use one of {', '.join(map(str, fits))}",
        )
    return tp


def _check_sequence_parallel(sp: int, tp: int, world_size: int, zero3: bool, where: str) -> None:
    if world_size % (sp * tp):
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UserError(
            "train.sequence_parallel_size",
            f"{sp} does not divide the world size {world_size}",
            f"use one of {', '.join(map(str, fits))}",
        )
    if not zero3:
        raise UserError(
            f"{where}: zero_optimization.stage",
            "sequence parallelism runs under ZeRO-3 only (how "
            "DeepSpeed reduces gradients over the sequence-parallel ranks differs by stage, and "
            "grpo_ds compensates for ZeRO-3's)",
            "use ds_configs/zero3.json or set the stage to 3",
        )


def _fill(cfg: dict, keys: list[str], value: Any, origin: str, where: str) -> None:
    """Set cfg[keys] to value when absent or "auto"; error when the file hard-codes a different
    value."""
    node = cfg
    for depth, k in enumerate(keys[:-1], start=1):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            dotted = ".".join(keys[:depth])
            raise UserError(
                f"{where}: {dotted}",
                f"must be a JSON object, got {json.dumps(node)}",
                f'e.g. "{dotted}": {{"{keys[depth]}": "auto"}}',
            )
    current = node.get(keys[-1], "auto")
    if current == "auto":
        node[keys[-1]] = value
        return
    same = (
        (current == value)
        if isinstance(value, bool) or isinstance(current, bool)
        else math.isclose(float(current), float(value), rel_tol=1e-9)
        if _is_number(current) and _is_number(value)
        else current == value
    )
    if not same:
        dotted = ".".join(keys)
        raise UserError(
            f"{where}: {dotted}",
            f"is {json.dumps(current)} but the recipe gives {json.dumps(value)} ({origin})",
            f'set {dotted} to "auto" (grpo_ds derives it) or to {json.dumps(value)}',
        )


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _resolve_optimizer(cfg: dict, recipe: Recipe, device_type: str, where: str) -> None:
    train = recipe.train
    # DeepSpeed's Adam is AdamW by default
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if str(opt.setdefault("type", "AdamW")).lower() not in ("adamw", "adam"):
        raise UserError(
            f"{where}: optimizer.type", f"{opt.get('type')!r} is not supported", 'use "AdamW"'
        )
    params = opt.setdefault("params", {})
    _fill(cfg, ["optimizer", "params", "lr"], train.lr, "train.lr", where)
    _fill(
        cfg,
        ["optimizer", "params", "weight_decay"],
        train.weight_decay,
        "train.weight_decay",
        where,
    )
    current_betas = params.get("betas", "auto")
    if current_betas != "auto" and current_betas != list(train.adam_betas):
        raise UserError(
            f"{where}: optimizer.params.betas",
            f"is {current_betas} but the recipe gives {train.adam_betas} (train.adam_betas)",
            f'set optimizer.params.betas to "auto" or to {json.dumps(list(train.adam_betas))}',
        )
    params["betas"] = list(train.adam_betas)
    params.setdefault("eps", 1e-8)
    if device_type == "cpu" and not offloaded(cfg.get("zero_optimization"), "offload_optimizer"):
        params.setdefault("torch_adam", True)  # DeepSpeed's fused Adam needs a GPU
        if params["torch_adam"] and not params.get("foreach"):
            # torch's fused CPU AdamW: one pass, in place; the default single-tensor path makes two
            # fp32 temporaries the size of the partition (the square root and the denominator)
            params.setdefault("fused", True)


def _resolve_lean_bf16(cfg: dict, recipe: Recipe, where: str) -> None:
    """train.lean_bf16 sets DeepSpeed's own bf16 master options (ZeRO 1-3): the optimizer's
    partition of the weights, its gradients and AdamW's moments stay bf16
    (deepspeed/runtime/precision_config.py). Off, the file's own values stand (DeepSpeed's default:
    fp32); on, a file that turns them off is an error naming the key."""
    if not recipe.train.lean_bf16:
        return
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        _fill(cfg, ["bf16", key], True, "train.lean_bf16", where)
    if zero_stage(cfg) == 0:
        raise UserError(
            "train.lean_bf16",
            "needs ZeRO stage 1, 2 or 3 (DeepSpeed keeps bf16 master weights in its "
            "ZeRO optimizer only)",
            'use ds_configs/zero3.json, or set "zero_optimization.stage" to 1-3',
        )
    if offloaded(cfg.get("zero_optimization"), "offload_optimizer"):
        raise UserError(
            "train.lean_bf16",
            "cannot offload the optimizer (DeepSpeed's CPU Adam keeps fp32 moments "
            "unless built otherwise)",
            "remove zero_optimization.offload_optimizer, or set train.lean_bf16 to false",
        )


def _resolve_scheduler(cfg: dict, recipe: Recipe, where: str) -> None:
    """train.warmup_steps and train.lr fill the warm-up keys of the scheduler, those it takes
    (WarmupLR: all)."""
    train = recipe.train
    if "scheduler" not in cfg:
        if train.warmup_steps == 0:
            return
        cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
    cls = scheduler_class(cfg["scheduler"].get("type"))
    # unknown: deepspeed_check says so
    takes = set(inspect.signature(cls).parameters) if cls is not None else set()
    params = cfg["scheduler"].setdefault("params", {})
    if "warmup_num_steps" not in takes and train.warmup_steps and cls is not None:
        raise UserError(
            "train.warmup_steps",
            f"is {train.warmup_steps} but the DeepSpeed scheduler "
            f"{cfg['scheduler']['type']} ({where}) has no warm-up",
            "set it to 0, or use WarmupLR",
        )
    filled = (
        ("warmup_max_lr", train.lr, "train.lr"),
        ("warmup_num_steps", train.warmup_steps, "train.warmup_steps"),
    )
    for key, value, origin in filled:
        if key in takes:
            _fill(cfg, ["scheduler", "params", key], value, origin, where)
    for key, value in (("warmup_min_lr", 0.0), ("warmup_type", "linear")):
        if key in takes:
            params.setdefault(key, value)


def _find_auto(node: Any, prefix: str = "") -> str | None:
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{prefix}.{k}" if prefix else k)
            if found:
                return found
    return prefix if node == "auto" else None
