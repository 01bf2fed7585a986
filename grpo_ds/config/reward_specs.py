"""The recipe's ``reward`` entries as values: each function spec's keys, types and default weight, each reward model
spec's keys, types and defaults, and the choices of ``reward.on_error``. Nothing here imports a reward function or
loads a model: grpo_ds.rewards.loading resolves the names later, and grpo_ds.reward_models checks the folders.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
import json
from typing import Any

from grpo_ds.config.parse import check_finite
from grpo_ds.errors import UserError, json_type_name, suggest

ON_ERROR_CHOICES = ("zero", "fail")  # reward.on_error: score a failed sample 0 and count it, or stop the run
DEFAULT_WEIGHT = 1.0  # the weight of a reward function whose spec gives none
_SPEC_KEYS = ("name", "weight")


@dataclass(frozen=True)
class RewardSpec:
    """One checked entry of the recipe's ``reward.functions``."""

    name: str  # a built-in name or "package.module:function", stripped
    weight: float  # DEFAULT_WEIGHT when the entry gives none


def parse_reward_specs(specs: list) -> list[RewardSpec]:
    """Check ``[{"name": ..., "weight": ...}, ...]`` (keys, types, a finite weight) and apply the default weight;
    the recipe's validation and ``load_reward_functions`` both read the entries through here. Imports nothing."""
    return [_parse_one(f"reward.functions[{i}]", spec) for i, spec in enumerate(specs)]


def _parse_one(where: str, spec: Any) -> RewardSpec:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise UserError(where, "must be an object with a string name", '{"name": "exact_match", "weight": 1.0}')
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}", "unknown key", suggest(unknown[0], _SPEC_KEYS))
    if not spec["name"].strip():
        raise UserError(f"{where}.name", "is empty", 'a built-in such as "exact_match", or package.module:function')
    weight = spec.get("weight", DEFAULT_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise UserError(f"{where}.weight", f"expected a number, got {json_type_name(weight)}", "e.g. 1.0")
    check_finite(f"{where}.weight", weight)  # the recipe's message for a NaN or an infinity, wherever it sits
    return RewardSpec(name=spec["name"].strip(), weight=float(weight))


OVERFLOW_CHOICES = ("truncate_left", "error")  # a reward model's input longer than its max_length


@dataclass(frozen=True)
class RewardModelSpec:
    """One checked entry of the recipe's ``reward.models``: a sequence-classification model with one label. Its score
    of a sample is ``(logit - mean) / std``, and the step's reward adds ``weight`` times it."""

    path: str  # a local HF folder (config, weights, tokenizer)
    name: str  # for its metrics (reward/NAME); default: the folder's name
    weight: float = DEFAULT_WEIGHT
    chat_template: bool = True  # render prompt + completion with the model's chat template (else: the plain text)
    max_length: int | None = None  # tokens of one scored text (null: the model's max_position_embeddings)
    overflow: str = "truncate_left"  # past max_length: keep the last max_length tokens (counted), or stop the run
    mean: float = 0.0
    std: float = 1.0
    offload: bool = False  # its weights leave the accelerator between steps


_MODEL_KEYS = tuple(f.name for f in fields(RewardModelSpec))


def parse_reward_model_specs(specs: list) -> list[RewardModelSpec]:
    """Check ``[{"path": ..., ...}, ...]`` (keys, types, ranges) and apply the defaults. Reads no file."""
    return [_parse_model(f"reward.models[{i}]", spec) for i, spec in enumerate(specs)]


def _parse_model(where: str, spec: Any) -> RewardModelSpec:
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or not spec["path"].strip():
        raise UserError(where, "must be an object with a string path", '{"path": "models/my_rm", "weight": 1.0}')
    unknown = sorted(set(spec) - set(_MODEL_KEYS))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}", "unknown key", suggest(unknown[0], _MODEL_KEYS))
    check_finite(where, spec)
    values = {"path": spec["path"].strip(), "name": spec.get("name", spec["path"].strip().rstrip("/").split("/")[-1])}
    for key, kind, example in (("name", str, '"helpfulness"'), ("weight", float, "1.0"), ("chat_template", bool, "true"),
                               ("max_length", int, "1024"), ("overflow", str, '"truncate_left"'),
                               ("mean", float, "0.0"), ("std", float, "1.0"), ("offload", bool, "false")):
        value = spec.get(key, values.get(key, getattr(RewardModelSpec, key, None)))
        if key == "max_length" and value is None:
            continue
        ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool) \
            if kind is not float else isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise UserError(f"{where}.{key}", f"expected {json_type_name(kind())}, got {json_type_name(value)}",
                            f"e.g. {example}")
        values[key] = float(value) if kind is float else value
    if not values["name"].strip():
        raise UserError(f"{where}.name", "is empty", "give the name its metrics are logged under")
    if values.get("max_length") is not None and values["max_length"] < 2:
        raise UserError(f"{where}.max_length", f"{values['max_length']} is too small", "use at least 2, or null")
    if values.get("overflow", "truncate_left") not in OVERFLOW_CHOICES:
        raise UserError(f"{where}.overflow", f"{json.dumps(values['overflow'])} is not one of "
                        f"{', '.join(map(json.dumps, OVERFLOW_CHOICES))}", '"truncate_left" or "error"')
    if values.get("std", 1.0) <= 0:
        raise UserError(f"{where}.std", f"{values['std']:g} is not positive", "a std > 0 (1.0 = no scaling)")
    return RewardModelSpec(**values)
