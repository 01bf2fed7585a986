"""How a key is declared: ``opt(default, doc, ...)``, a dataclass field whose metadata holds its
one-line doc and, where it applies, its allowed choices and numeric range. The recipe's sections
(grpo_ds/config/recipe.py, recipe_rollout.py and recipe_training.py) and the entries of its lists
(``reward.models[]``, grpo_ds/config/reward_specs.py) are declared with it; the per-field checks
(grpo_ds.config.parse.check_field), the dry run and the recipe reference (grpo_ds.config.reference)
read it.
"""

from __future__ import annotations

import json
from dataclasses import field
from typing import Any

REQUIRED = object()  # opt(REQUIRED, ...): a key with no default, which an entry must give


def opt(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    example: Any = None,
) -> Any:
    """Declare a field: its default (or REQUIRED), a one-line doc, and optionally allowed choices or
    a range.

    ``low``/``high`` bound numbers inclusively; ``low_open`` makes the lower bound exclusive.
    ``example``: the value an error message suggests where the default cannot serve as one
    (REQUIRED, or null).
    """
    meta = {
        "doc": doc,
        "choices": choices,
        "low": low,
        "high": high,
        "low_open": low_open,
        "example": example,
    }
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta)
    return field(default=default, metadata=meta)
