"""Loading a recipe: read it, apply the overrides, build the schema's dataclasses, then run the
cross-key rules.

Load order (nothing touches a model): JSON file or dict -> ``section.key=value`` overrides -> type,
choice and range checks per field while building the frozen ``Recipe`` (grpo_ds.config.parse, from
grpo_ds.config.recipe's declarations) -> cross-key checks, above all the batch algebra
(grpo_ds.config.rules). Every mistake is one UserError.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_ds.config.parse import (
    apply_override,
    build,
    normalise_overrides,
    printable,
    read_json_object,
)
from grpo_ds.config.recipe import SECTIONS, TOP_LEVEL_VALUES, Recipe
from grpo_ds.config.rules import validate
from grpo_ds.errors import UserError


def load_recipe(source: str | Path | dict, overrides: list[str] | dict | None = None) -> Recipe:
    """Read a recipe (JSON path or dict), apply overrides, validate everything; raise UserError if
    bad."""
    if isinstance(source, dict):
        raw, where, source_dir = json.loads(json.dumps(source)), "recipe", "."
    else:
        path = Path(source)
        where, source_dir = str(path), str(path.parent)
        if not path.is_file():
            what = "is a folder, not a recipe file" if path.is_dir() else "recipe file not found"
            raise UserError(printable(where), what, "check the path, e.g. recipes/tiny_cpu.json")
        raw = read_json_object(path, "a recipe", '{"run": {...}, ...}')
    for key, value in normalise_overrides(overrides):
        apply_override(raw, key, value, SECTIONS, TOP_LEVEL_VALUES)
    recipe = build(Recipe, raw, where, source_dir, SECTIONS, TOP_LEVEL_VALUES)
    validate(recipe)
    return recipe
