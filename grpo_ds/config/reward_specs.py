"""The recipe's ``reward`` entries as values, parsed in one place: ``reward_specs(recipe.reward)``
checks ``reward.functions`` and ``reward.models`` (keys, types, ranges, distinct names) once per
recipe and returns one ``RewardSpecs``, which the recipe's rules, the preflight, the memory
estimate, the dry run and the scorers share. Nothing here imports a reward function or loads a
model: grpo_ds.rewards.loading resolves the names later, and grpo_ds.model.reward_model_checks
checks the folders.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from grpo_ds.config.options import REQUIRED, opt
from grpo_ds.config.parse import check_field, check_finite, printable
from grpo_ds.errors import UserError, json_type_name, suggest

# reward.on_error: score a failed sample 0 and count it, or stop the run
ON_ERROR_CHOICES = ("zero", "fail")
DEFAULT_WEIGHT = 1.0  # the weight of a reward function whose spec gives none
_FUNCTION_KEYS = ("name", "weight")


@dataclass(frozen=True)
class RewardFunctionSpec:
    """One checked entry of the recipe's ``reward.functions``."""

    name: str  # a built-in name or "package.module:function", stripped
    weight: float  # DEFAULT_WEIGHT when the entry gives none


OVERFLOW_CHOICES = ("truncate_left", "error")  # a reward model's input longer than its max_length


@dataclass(frozen=True)
class RewardModelSpec:
    """One checked entry of the recipe's ``reward.models``: a sequence-classification model with one
    label. Its score of a sample is ``(logit - mean) / std``, and the step's reward adds ``weight``
    times it. Each field's declaration is the entry key's whole definition: its check
    (``parse_rewards``) and its page in the recipe reference (grpo_ds.config.reference) read it."""

    path: str = opt(
        REQUIRED,
        "A local Hugging Face folder (relative to the working directory, as model.path) "
        "holding a sequence-classification model with one label (config.json, the weights) and its "
        'tokenizer; a Hugging Face Hub id "owner/name" of such a model, fetched into the Hugging '
        'Face cache once per node, as model.path; or "builtin:digitD" (D a digit: the hand-set '
        "digit reward model, whose score rises with the share of that digit in the text, written "
        "on first use into grpo_ds's cache, $GRPO_DS_CACHE or ~/.cache/grpo_ds)",
        example="models/my_rm",
    )
    revision: str | None = opt(
        None,
        "Hub id only: the branch, tag or commit of path (null = the repository's default branch)",
        example="main",
    )
    name: str | None = opt(
        None,
        "The name of its metrics (reward/NAME); distinct from the other reward models' "
        "(null = the folder's or the Hub repository's name; a builtin's, digitD)",
        example="helpfulness",
    )
    weight: float = opt(
        DEFAULT_WEIGHT,
        "Its score's weight in the step's reward, a weighted sum over the functions "
        "and the models (negative: a penalty)",
    )
    chat_template: bool = opt(
        True,
        "Render prompt + completion as a user and an assistant message with the reward "
        "model's own chat template (false = the plain text prompt + completion)",
    )
    max_length: int | None = opt(
        None,
        "Most tokens of one scored text, in the reward model's tokenizer (null = its "
        "max_position_embeddings; at most that)",
        low=2,
        example=1024,
    )
    overflow: str = opt(
        "truncate_left",
        "A text longer than max_length: keep its last max_length tokens (counted in "
        "the metrics), or stop the run",
        choices=OVERFLOW_CHOICES,
    )
    mean: float = opt(
        0.0, "Affine normalisation: score = (logit - mean) / std; the logit's offset (0 = none)"
    )
    std: float = opt(
        1.0,
        "Affine normalisation: score = (logit - mean) / std; the logit's scale (1 = none)",
        low=0.0,
        low_open=True,
    )
    offload: bool = opt(
        False, "Its weights leave the accelerator between steps (back only while it scores)"
    )

    def __post_init__(self):
        if self.name is None:  # the folder's name (a builtin's: digit7); the spec always holds one
            name = self.path.strip().rstrip("/").split("/")[-1].removeprefix("builtin:")
            object.__setattr__(self, "name", name)


@dataclass(frozen=True)
class RewardSpecs:
    """The recipe's reward section, parsed: every reward function and every reward model, in the
    recipe's order, with their defaults applied."""

    functions: tuple[RewardFunctionSpec, ...]
    models: tuple[RewardModelSpec, ...]


class RewardSection(Protocol):
    """What ``reward_specs`` reads of the recipe's ``reward`` section
    (grpo_ds.config.recipe.RewardConfig)."""

    functions: list
    models: list


_PARSED = "_parsed_specs"  # where a section keeps its RewardSpecs


def reward_specs(reward: RewardSection) -> RewardSpecs:
    """``recipe.reward``'s entries parsed once: the first call parses them (``parse_rewards``) and
    the frozen section keeps the result, as functools.cached_property keeps a value, so every later
    reader gets the same specs."""
    parsed = vars(reward).get(_PARSED)
    if parsed is None:
        parsed = vars(reward)[_PARSED] = parse_rewards(reward.functions, reward.models)
    return parsed


def parse_rewards(functions: Sequence, models: Sequence) -> RewardSpecs:
    """The one parser of ``reward.functions`` (``[{"name": ..., "weight": ...}, ...]``) and
    ``reward.models`` (``[{"path": ..., ...}, ...]``): each entry's keys, types, ranges and choices,
    as its fields declare them, and its defaults; distinct model names, none a function's name too
    (their metrics reward/NAME must not mix). Raise UserError at the first bad entry. Reads no
    file."""
    parsed = RewardSpecs(
        functions=tuple(
            _parse_function(f"reward.functions[{i}]", entry) for i, entry in enumerate(functions)
        ),
        models=tuple(_parse_model(f"reward.models[{i}]", entry) for i, entry in enumerate(models)),
    )
    names = [spec.name for spec in parsed.models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UserError(
                f"reward.models[{i}].name",
                f"{json.dumps(name)} is the name of reward.models"
                f"[{names.index(name)}] too (each model's metrics are logged under its name)",
                'give each a distinct "name"',
            )
    function_names = {spec.name for spec in parsed.functions}
    for i, name in enumerate(names):
        if name in function_names:
            raise UserError(
                f"reward.models[{i}].name",
                f'"{name}" is the name of a reward '
                "function too (their metrics reward/NAME would mix)",
                'give the model another "name"',
            )
    return parsed


def _parse_function(where: str, spec: Any) -> RewardFunctionSpec:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise UserError(
            where, "must be an object with a string name", '{"name": "exact_match", "weight": 1.0}'
        )
    unknown = sorted(set(spec) - set(_FUNCTION_KEYS))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}", "unknown key", suggest(unknown[0], _FUNCTION_KEYS))
    if not spec["name"].strip():
        raise UserError(
            f"{where}.name",
            "is empty",
            'a built-in such as "exact_match", or package.module:function',
        )
    weight = spec.get("weight", DEFAULT_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise UserError(
            f"{where}.weight", f"expected a number, got {json_type_name(weight)}", "e.g. 1.0"
        )
    check_finite(f"{where}.weight", weight)  # the recipe's message for a NaN or an infinity
    return RewardFunctionSpec(name=spec["name"].strip(), weight=float(weight))


def _parse_model(where: str, spec: Any) -> RewardModelSpec:
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("path"), str)
        or not spec["path"].strip()
    ):
        raise UserError(
            where, "must be an object with a string path", '{"path": "models/my_rm", "weight": 1.0}'
        )
    declared = {f.name: f for f in fields(RewardModelSpec)}
    unknown = sorted(set(spec) - set(declared))
    if unknown:
        raise UserError(
            f"{where}.{printable(unknown[0])}", "unknown key", suggest(unknown[0], declared)
        )
    values = {
        key: check_field(f"{where}.{key}", value, declared[key], RewardModelSpec)
        for key, value in spec.items()
    }
    values["path"] = values["path"].strip()
    if values.get("name") is not None and not values["name"].strip():
        raise UserError(
            f"{where}.name", "is empty", "give the name its metrics are logged under, or null"
        )
    return RewardModelSpec(**values)
