"""The recipe reference, generated from the schema: one markdown table per section (key, type, default, allowed
values, meaning) from the field declarations in grpo_ds/config/recipe.py.

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
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def tables() -> str:
    """Markdown: a ``## `section``` heading and a table per section."""
    out, current = [], object()
    for section, f in iter_fields():
        if section != current:
            current = section
            title = f"`{section}`" if section else f"`{f.name}` (a top-level value, not a section)"
            out += ["", f"## {title}", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        key = f"{section}.{f.name}" if section else f.name
        out.append(f"| `{key}` | {_type_name(f.type)} | `{json.dumps(default)}` | {_allowed(f.metadata)} | "
                   f"{_escape(f.metadata['doc'])} |")
    return "\n".join(out[1:]) + "\n"


if __name__ == "__main__":
    print(tables(), end="")
