"""The recipe reference, generated from the schema: a heading per section and, under it, one definition per key (the
key whole on its own line; below it, its meaning, then its type, default and allowed values) from the field
declarations in grpo_ds/config/recipe.py. A definition per key, not a table, so that a key never wraps in a narrow
column and its meaning is read without scrolling sideways on a phone.

docs/generate.py writes it into docs/reference/recipe.md, and tests/test_docs.py checks that the page holds exactly
this text; ``python -m grpo_ds.config.reference`` prints it.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing

from grpo_ds.config.recipe import iter_fields

_TYPE_NAMES = {str: "string", bool: "bool", int: "int", float: "float", list: "list", dict: "object"}


def _type_name(annotation) -> str:
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307 - our schema
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
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
    """Markdown (with the def_list extension): a ``## `section``` heading per section, then per key::

        `section.key`
        :   Its meaning

            type · default `value` · allowed values
    """
    out, current = [], object()
    for section, f in iter_fields():
        if section != current:
            current = section
            out += ["", f"## `{section}`" if section else f"## `{f.name}` (a top-level value, not a section)"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        allowed = _allowed(f.metadata)
        facts = [_type_name(f.type), f"default `{json.dumps(default)}`"] + ([allowed] if allowed else [])
        out += ["", f"`{section}.{f.name}`" if section else f"`{f.name}`", f":   {_escape(f.metadata['doc'])}", "",
                "    " + " · ".join(facts)]
    return "\n".join(out[1:]) + "\n"


if __name__ == "__main__":
    print(definitions(), end="")
