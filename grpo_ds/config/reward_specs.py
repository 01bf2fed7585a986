"""The recipe's ``reward`` entries as values: each function spec's keys, types and default weight, and the choices of
``reward.on_error``. Nothing here imports a reward function: grpo_ds.rewards.loading resolves the names later.
"""

from __future__ import annotations

from dataclasses import dataclass
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
