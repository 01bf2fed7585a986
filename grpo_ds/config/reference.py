"""The recipe reference, generated from the schema: a heading per section and, under it, one
definition per key (the key whole on its own line; below it, its meaning, then its type, default and
allowed values) from the field declarations in the schema (grpo_ds/config/recipe.py and the
sections it composes from recipe_rollout.py and recipe_training.py); after its section, each key
of a list's entries (``reward.models[]``), from its entry's dataclass (``ENTRIES``), declared the
same way. A definition per key, not a table, so that a key never wraps in a narrow column and its
meaning is read without scrolling sideways on a phone.

docs/generate.py writes it into docs/reference/recipe.md, and tests/test_docs.py checks that the
page holds exactly this text; ``python -m grpo_ds.config.reference`` prints it.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing

from grpo_ds.config.recipe import iter_fields
from grpo_ds.config.reward_specs import RewardModelSpec

# A list key whose entries are objects of declared keys -> the entry's dataclass (its fields
# declared with opt)
ENTRIES: dict[str, type] = {"reward.models": RewardModelSpec}

_TYPE_NAMES = {
    str: "string",
    bool: "bool",
    int: "int",
    float: "float",
    list: "list",
    dict: "object",
}


def _type_name(annotation) -> str:
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307 - our schema
    args = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    if hint is typing.Any:
        return "string or object"
    names = [_TYPE_NAMES.get(typing.get_origin(a) or a, "any") for a in args if a is not type(None)]
    return " or ".join(names) + (" or null" if type(None) in args else "")


def _allowed(meta: dict) -> str:
    if meta.get("choices"):
        return "one of " + ", ".join(f"`{json.dumps(c)}`" for c in meta["choices"])
    parts = []
    if meta.get("low") is not None:
        parts.append(f"{'>' if meta.get('low_open') else '>='} {meta['low']:g}")
    if meta.get("high") is not None:
        parts.append(f"<= {meta['high']:g}")
    return " and ".join(parts)


def _escape(text: str) -> str:
    return text.replace("<", "&lt;").replace(">", "&gt;")


def definitions() -> str:
    """Markdown (with the def_list extension): a ``## `section``` heading per section, then per
    key::

        `section.key`{#section.key}
        :   Its meaning

            type · default `value` · allowed values

    and after the section, for each of its list keys in ``ENTRIES``, a ``### `section.key[]` ``
    heading and the same per key of an entry (`` `section.key[].entry_key` ``; "required" for a key
    without a default)."""
    out, current = [], object()
    for section, f in iter_fields():
        if section != current:
            out += _entries(current)
            current = section
            out += [
                "",
                f"## `{section}`"
                if section
                else f"## `{f.name}` (a top-level value, not a section)",
            ]
        out += _definition(f"{section}.{f.name}" if section else f.name, f)
    out += _entries(current)
    return "\n".join(out[1:]) + "\n"


def _entries(section) -> list[str]:
    out = []
    for key, spec in ENTRIES.items():
        if key.rpartition(".")[0] == section:
            out += ["", f"### `{key}[]`: the keys of each entry"]
            for f in dataclasses.fields(spec):
                out += _definition(f"{key}[].{f.name}", f)
    return out


def _definition(key: str, f: dataclasses.Field) -> list[str]:
    if f.default is not dataclasses.MISSING:
        default = f"default `{json.dumps(f.default)}`"
    elif f.default_factory is not dataclasses.MISSING:
        default = f"default `{json.dumps(f.default_factory())}`"
    else:
        default = "required"
    allowed = _allowed(f.metadata)
    facts = [_type_name(f.type), default] + ([allowed] if allowed else [])
    return [
        "",
        f"`{key}`{{#{key_anchor(key)}}}",
        f":   {_escape(f.metadata['doc'])}",
        "",
        "    " + " · ".join(facts),
    ]


def key_anchor(key: str) -> str:
    """The id of a key's definition on the reference page, which guides link to
    (docs/reference/recipe.md#rollout.max_staleness): the key, an entry's ``[]`` left out."""
    return key.replace("[]", "")


if __name__ == "__main__":
    print(definitions(), end="")
