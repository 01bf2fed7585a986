"""The builtin reward models a recipe names by ``builtin:digitD`` (``reward.models[].path``): the
hand-set digit model of grpo_ds.reward_models.tiny, written on first use into grpo_ds's cache folder
and read from there by every later run. Nothing is downloaded."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from grpo_ds.errors import UserError
from grpo_ds.reward_models.tiny import write_digit_reward_model
from grpo_ds.run.writes import describe, folder_written

BUILTIN_DIGIT = re.compile(r"builtin:digit(\d)")
# the builtin models' folders carry this: a grpo_ds whose digit model changed writes new ones
BUILTIN_VERSION = 1


def cache_folder() -> Path:
    """Where grpo_ds keeps what it writes for reuse across runs: $GRPO_DS_CACHE, else grpo_ds/ under
    $XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get("GRPO_DS_CACHE"):
        return Path(os.environ["GRPO_DS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpo_ds"


def builtin_reward_model(where: str, path: str) -> Path | None:
    """The folder of the builtin reward model ``path`` names (``builtin:digitD``: the digit model
    of D), written on first use, whole or not at all (every rank of a node may ask at once: the
    first to take the cache's lock writes it, the others then find it); None for a path that names
    no builtin model."""
    if not path.startswith("builtin:"):
        return None
    named = BUILTIN_DIGIT.fullmatch(path)
    if named is None:
        raise UserError(
            where,
            f"unknown builtin reward model {path!r}",
            'the builtin reward models are "builtin:digit0" to "builtin:digit9" (the digit '
            "model: its score rises with the share of that digit in the text)",
        )
    digit = named.group(1)
    folder = cache_folder() / "builtin" / f"digit{digit}_rm-v{BUILTIN_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f".{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "config.json").is_file():
                with folder_written(folder) as written:
                    write_digit_reward_model(written, digit)
    except OSError as err:
        raise UserError(
            where,
            f"cannot write {path} into {folder.parent} ({describe(err)})",
            "set GRPO_DS_CACHE to a folder you can write in",
        ) from None
    return folder
