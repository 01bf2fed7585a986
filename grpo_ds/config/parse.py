"""JSON objects into the recipe's frozen dataclasses (grpo_ds.config.recipe declares them): files,
``section.key=value`` overrides, and the per-field type, choice and range checks that every field's
declaration (``options.opt``) drives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from grpo_ds.errors import UserError, first_line, json_type_name, suggest


def read_json_object(path: Path, what: str, example: str) -> dict:
    """A JSON file that must hold one object; syntax errors point at line and column. A file that
    cannot be read (permissions, not UTF-8, nested too deeply to parse) is one UserError too."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        where = f"{path}:{err.lineno}:{err.colno}"
        raise UserError(where, f"invalid JSON ({err.msg})", "fix the JSON syntax") from None
    except UnicodeDecodeError as err:
        raise UserError(
            str(path),
            f"is not UTF-8 text (byte {err.start} is {err.object[err.start : err.start + 1]!r})",
            "save it as UTF-8",
        ) from None
    except RecursionError:
        raise UserError(
            str(path), "is nested too deeply to parse", "a recipe is a few levels deep"
        ) from None
    except OSError as err:
        raise UserError(
            str(path),
            f"cannot be read ({err.strerror or first_line(err)})",
            "check the path and its permissions",
        ) from None
    if not isinstance(raw, dict):
        raise UserError(str(path), f"{what} must be a JSON object", f"e.g. {example}")
    return raw


def nonfinite_in(value: Any, at: str = "") -> tuple[str, float] | None:
    """The first NaN or infinity inside a JSON value (JSON parsers accept NaN, Infinity and 1e999):
    its place below ``value`` (".key", "[2]", "" for the value itself) and the number; None when
    every number is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return at, value
    children = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, (list, tuple))
        else ()
    )
    for key, child in children:
        found = nonfinite_in(child, f"{at}[{key}]" if isinstance(key, int) else f"{at}.{key}")
        if found:
            return found
    return None


def check_finite(where: str, value: Any, fix: str = "give a finite number") -> None:
    """Raise UserError at the first NaN or infinity inside ``value`` (every number a recipe holds
    must be finite). A ``where`` ending in ":" names a file: the key follows it ("ds.json:
    zero_optimization.stage")."""
    found = nonfinite_in(value)
    if found:
        at, number = found
        place = f"{where} {at[1:]}" if where.endswith(":") and at.startswith(".") else where + at
        raise UserError(
            place,
            f"{json.dumps(number)} is not a finite number (JSON allows NaN and Infinity, a "
            "recipe does not)",
            fix,
        )


def printable(text: str) -> str:
    """User text as a message shows it: as it is, or JSON-quoted when it holds line breaks or other
    control characters (an error is one line)."""
    return text if text.isprintable() else json.dumps(text)


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value``: the value is JSON when it parses, otherwise a plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UserError(f"override {text!r}", "expected section.key=value", "e.g. train.lr=1e-5")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def normalise_overrides(overrides: list[str] | dict | None) -> list[tuple[str, Any]]:
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    return [parse_override(o) for o in overrides]


def apply_override(
    raw: dict, key: str, value: Any, sections: dict[str, type], top_level: tuple[str, ...]
) -> None:
    """Set ``section.key`` (or a top-level value, or a key of an inline deepspeed object) in the raw
    recipe."""
    where = f"override {printable(key)}"
    parts = key.split(".")
    if parts[0] in top_level and len(parts) == 1:
        raw[parts[0]] = value
        return
    # deepspeed.zero_optimization.stage=2 edits an inline object
    if parts[0] == "deepspeed" and len(parts) > 1:
        if not isinstance(raw.get("deepspeed"), dict):
            raise UserError(
                where,
                "deepspeed is a file path, so its keys cannot be overridden one by one",
                "edit the file, or give an inline deepspeed object in the recipe",
            )
        target = raw["deepspeed"]
        for depth, p in enumerate(parts[1:-1], start=1):
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise UserError(
                    where,
                    f"deepspeed.{printable('.'.join(parts[1 : depth + 1]))} is not an object",
                    'override the key itself, e.g. deepspeed.train_batch_size="auto"',
                )
        target[parts[-1]] = value
        return
    if len(parts) != 2:
        raise UserError(where, "overrides are section.key=value", "e.g. train.lr=1e-5")
    section, name = parts
    if section not in sections:
        raise UserError(
            where, f"unknown section {section!r}", suggest(section, list(sections) + ["deepspeed"])
        )
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise UserError(section, "must be a JSON object", f'write "{section}": {{...}}')
    raw[section][name] = value


def build(
    recipe_cls: type,
    raw: dict,
    where: str,
    source_dir: str,
    sections: dict[str, type],
    top_level: tuple[str, ...],
) -> Any:
    """The frozen recipe of a raw JSON object: every section's keys checked against their
    declarations."""
    values: dict[str, Any] = {"source_dir": source_dir}
    for key, section_raw in raw.items():
        if key in top_level:
            if not isinstance(section_raw, (str, dict)):
                raise UserError(
                    key,
                    f"must be a path string or a JSON object, got {json_type_name(section_raw)}",
                    'e.g. "ds_configs/zero3.json"',
                )
            check_finite(key, section_raw)
            values[key] = section_raw
            continue
        if key not in sections:
            raise UserError(
                f"{where}: {printable(key)}",
                "unknown section",
                suggest(key, list(sections) + ["deepspeed"]),
            )
        if not isinstance(section_raw, dict):
            raise UserError(
                key,
                f"must be a JSON object, got {json_type_name(section_raw)}",
                f'write "{key}": {{...}}',
            )
        values[key] = _build_section(key, sections[key], section_raw)
    return recipe_cls(**values)


def _build_section(section: str, cls: type, raw: dict) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in raw.items():
        if name not in known:
            raise UserError(f"{section}.{printable(name)}", "unknown key", suggest(name, known))
        f = known[name]
        kwargs[name] = check_field(f"{section}.{name}", value, f, cls)
    return cls(**kwargs)


def check_field(where: str, value: Any, f: dataclasses.Field, owner: type) -> Any:
    """Check one value against its declared type, choices and range (``opt``,
    grpo_ds.config.options); return it (ints widened to float). ``owner``: the dataclass declaring
    ``f`` (a recipe section, a list entry's spec)."""
    hint = typing.get_type_hints(owner)[f.name]
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    nullable = type(None) in args
    base = next(a for a in args if a is not type(None))
    default = _example(f)
    if value is None:
        if nullable:
            return None
        raise UserError(where, "must not be null", f"give a value like {json.dumps(default)}")
    number = isinstance(default, (int, float)) and not isinstance(default, bool)
    check_finite(
        where, value, f"give a finite number, e.g. {default}" if number else "give a finite number"
    )
    _check_type(where, value, base, default)
    if base is float:
        value = float(value)
    _check_choices_and_range(where, value, f.metadata, default)
    return value


def _example(f: dataclasses.Field) -> Any:
    """The value a message suggests: the field's ``example`` where it declares one (a required key,
    or one whose default is null), else its default (None where it has none)."""
    if f.metadata.get("example") is not None:
        return f.metadata["example"]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _check_type(where: str, value: Any, base: type, default: Any) -> None:
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list),
        dict: isinstance(value, dict),
    }[base]
    if not ok:
        raise UserError(
            where,
            f"expected {json_type_name(base())}, got {json_type_name(value)} {json.dumps(value)}",
            f"e.g. {json.dumps(default)}",
        )


def _check_choices_and_range(where: str, value: Any, meta: Mapping, default: Any) -> None:
    if meta.get("choices") and value not in meta["choices"]:
        raise UserError(
            where,
            f"{value!r} is not one of {', '.join(map(repr, meta['choices']))}",
            suggest(str(value), meta["choices"], "valid values")
            if isinstance(value, str)
            else "pick one of them",
        )
    low, high = meta.get("low"), meta.get("high")
    if low is not None and (value < low or (meta.get("low_open") and value == low)):
        rule = f"> {low}" if meta.get("low_open") else f">= {low}"
        raise UserError(
            where,
            f"{value} is out of range: must be {rule}" + (f" and <= {high}" if high else ""),
            f"e.g. {default}" if default is not None else "use a larger value",
        )
    if high is not None and value > high:
        raise UserError(where, f"{value} is out of range: must be <= {high}", f"e.g. {default}")
