"""The resolved DeepSpeed config, validated the way DeepSpeed validates it, before any engine or
model exists.

``check_deepspeed_config`` builds DeepSpeed's own ``DeepSpeedConfig`` from the resolved dict (its
pydantic models check the ZeRO section, offload devices, the fp16/bf16 blocks, the comms and monitor
sections...; its asserts check precision and stage combinations), then adds what DeepSpeed checks
only when it builds the engine: an nvme offload without ``nvme_path``, the scheduler's type and
parameters (DeepSpeed instantiates ``lr_schedules.<type>`` or ``torch.optim.lr_scheduler.<type>``
with them), ``max_grad_norm`` among the optimizer's parameters, and ``data_types.param_dtype``
against the precision that model.dtype enables. grpo_ds's own rules (batch keys, optimizer type,
precision from model.dtype) are in grpo_ds.config.deepspeed. Each problem is one UserError naming
the key in the DeepSpeed file.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from typing import Any

from grpo_ds.config.dtypes import DEEPSPEED_SECTIONS, canonical
from grpo_ds.distributed import launcher
from grpo_ds.errors import UserError, first_line, suggest

_STAGES = (0, 1, 2, 3)
_DOCS = "see https://www.deepspeed.ai/docs/config-json/"


def check_deepspeed_config(cfg: dict, where: str, model_dtype: str, device_type: str) -> None:
    """Raise UserError for anything in ``cfg`` (a resolved config) that DeepSpeed would reject."""
    choose_accelerator(device_type)
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(
            f"{where}: zero_optimization",
            f"must be a JSON object, got {json.dumps(zero)}",
            'e.g. "zero_optimization": {"stage": 3}',
        )
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in _STAGES:
        raise UserError(
            f"{where}: zero_optimization.stage",
            f"{json.dumps(stage)} is not a ZeRO stage",
            "use 0, 1, 2 or 3 (grpo_ds's ds_configs use 3)",
        )
    _deepspeed_validation(cfg, where)
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section)
        if (
            isinstance(offload, dict)
            and offload.get("device") == "nvme"
            and not offload.get("nvme_path")
        ):
            raise UserError(
                f"{where}: zero_optimization.{section}.nvme_path",
                'is needed with device "nvme"',
                'give a folder on the NVMe drive, or use device "cpu"',
            )
    params = (cfg.get("optimizer") or {}).get("params") or {}
    if "max_grad_norm" in params:
        raise UserError(
            f"{where}: optimizer.params.max_grad_norm",
            "is not an optimizer parameter in DeepSpeed",
            "remove it: train.max_grad_norm sets gradient_clipping",
        )
    _check_param_dtype(cfg, where, model_dtype)
    _check_scheduler(cfg.get("scheduler"), where)


def check_shapes(raw: dict, where: str) -> None:
    """The sections grpo_ds reads and fills are JSON objects (a DeepSpeed file before
    resolution)."""
    for dotted in (
        "zero_optimization",
        "optimizer",
        "optimizer.params",
        "scheduler",
        "scheduler.params",
        "bf16",
        "fp16",
        "tensor_parallel",
    ):
        node: Any = raw
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            raise UserError(
                f"{where}: {dotted}", f"must be a JSON object, got {json.dumps(node)}", _DOCS
            )
    betas = ((raw.get("optimizer") or {}).get("params") or {}).get("betas", "auto")
    if betas != "auto" and not isinstance(betas, list):
        raise UserError(
            f"{where}: optimizer.params.betas",
            f"must be a list of two numbers, got {json.dumps(betas)}",
            'e.g. "auto" (train.adam_betas)',
        )


def scheduler_class(name: Any) -> type | None:
    """The class DeepSpeed instantiates for ``scheduler.type`` (its own lr_schedules first, then
    torch's)."""
    import torch
    from deepspeed.runtime import lr_schedules

    if not isinstance(name, str) or not name:
        return None
    return getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)


def check_precision_supported(cfg: dict, device_type: str) -> None:
    """On the machine that runs: DeepSpeed refuses fp16 or bf16 that the accelerator lacks (when it
    builds the engine, after the model has loaded)."""
    choose_accelerator(device_type)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for dtype, section in DEEPSPEED_SECTIONS.items():
        if (cfg.get(section) or {}).get("enabled") is True and not getattr(
            accelerator, f"is_{section}_supported"
        )():
            raise UserError(
                "model.dtype",
                f'"{dtype}" is not supported by DeepSpeed on this {device_type} '
                f"accelerator ({accelerator.device_name()})",
                'use "float32"' + ("" if section == "bf16" else ' or "bfloat16"'),
            )


def choose_accelerator(device_type: str) -> None:
    """DeepSpeed picks its accelerator when first imported: on a CPU, its CPU one
    (grpo_ds.distributed.launcher)."""
    if device_type == "cpu":
        launcher.use_cpu_accelerator()


def _deepspeed_validation(cfg: dict, where: str) -> None:
    """DeepSpeed's own config parsing. train_batch_size is left out: grpo_ds derived it for the real
    world size (grpo_ds.config.deepspeed), and DeepSpeed would check it against the world size of
    this process (1)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    config = {k: v for k, v in copy.deepcopy(cfg).items() if k != "train_batch_size"}
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it logs its world size on every parse
    try:
        DeepSpeedConfig(config)
    except ValidationError as err:
        raise _pydantic_error(err, config, where) from None
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise UserError(
            where, f"DeepSpeed rejects it: {first_line(err) or type(err).__name__}", _DOCS
        ) from None
    finally:
        quiet.setLevel(level)


def _pydantic_error(err: Any, cfg: dict, where: str) -> UserError:
    """The first error of a DeepSpeed pydantic model, at the key it concerns in the user's
    config."""
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    dotted = _locate(cfg, loc) or f"{err.title}.{'.'.join(loc)}"
    if first.get("type") == "extra_forbidden":
        model = _model_class(err.title)
        names = [
            n
            for f_name, f in (model.model_fields.items() if model else ())
            for n in (f_name, f.alias)
            if n
        ]
        fix = suggest(loc[-1], names) if names else _DOCS
        return UserError(f"{where}: {dotted}", "is not a key DeepSpeed knows", fix)
    msg = first.get("msg", "invalid").removeprefix("Value error, ")
    shown = json.dumps(first.get("input"), default=str)[:60]
    return UserError(f"{where}: {dotted}", f"{shown} is rejected by DeepSpeed ({msg})", _DOCS)


def _locate(cfg: dict, loc: list[str]) -> str | None:
    """The dotted key of ``cfg`` that ends in ``loc`` (pydantic errors name the path below their own
    section)."""
    if not loc:
        return None
    for key, value in cfg.items():
        node, ok = value, True
        for part in loc:
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                ok = False
                break
        if ok:
            return ".".join([key, *loc])
    return None


def _model_class(title: str) -> type | None:
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    todo = [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        if cls.__name__ == title:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def _check_param_dtype(cfg: dict, where: str, model_dtype: str) -> None:
    """DeepSpeed asserts (when it builds the engine) that data_types.param_dtype is the dtype
    fp16/bf16 enable."""
    requested = (
        (cfg.get("data_types") or {}).get("param_dtype")
        if isinstance(cfg.get("data_types"), dict)
        else None
    )
    if requested is None:
        return
    dtype = canonical(requested)
    if dtype is None:
        raise UserError(
            f"{where}: data_types.param_dtype",
            f"{json.dumps(requested)} is not a dtype DeepSpeed knows",
            f'leave it out (model.dtype sets the precision), or "{model_dtype}"',
        )
    if dtype != model_dtype:
        raise UserError(
            f"{where}: data_types.param_dtype",
            f"is {json.dumps(requested)} but model.dtype is "
            f'"{model_dtype}" (DeepSpeed requires the two to agree)',
            "leave it out, or change model.dtype",
        )


def _check_scheduler(scheduler: Any, where: str) -> None:
    if scheduler is None:
        return
    if not isinstance(scheduler, dict):
        raise UserError(
            f"{where}: scheduler",
            f"must be a JSON object, got {json.dumps(scheduler)}",
            'e.g. {"type": "WarmupLR", "params": {}}, or leave it out',
        )
    name, params = scheduler.get("type"), scheduler.get("params", {})
    cls = scheduler_class(name)
    if cls is None:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

        raise UserError(
            f"{where}: scheduler.type",
            f"{json.dumps(name)} is not a scheduler DeepSpeed knows",
            suggest(str(name), VALID_LR_SCHEDULES, "DeepSpeed's own") + " (or a class of "
            "torch.optim.lr_scheduler)",
        )
    if not isinstance(params, dict):
        raise UserError(
            f"{where}: scheduler.params",
            f"must be a JSON object, got {json.dumps(params)}",
            f"give {name}'s keyword arguments",
        )
    signature = inspect.signature(cls)
    accepted = [p for p in signature.parameters if p != "optimizer"]
    for key in params:
        if key not in accepted:
            raise UserError(
                f"{where}: scheduler.params.{key}",
                f"is not a parameter of {name}",
                suggest(key, accepted, f"{name} takes"),
            )
    try:
        signature.bind(None, **params)
    except TypeError as err:
        raise UserError(
            f"{where}: scheduler.params",
            f"{name}: {first_line(err)}",
            f"give every parameter {name} needs",
        ) from None
