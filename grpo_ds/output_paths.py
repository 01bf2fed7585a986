"""Output folders, checked before anything is written: each must be a writable folder, or one that can be created.

A run writes only inside its run folder ``run.output_dir/run.name`` (checkpoints, metrics, logs, traces, the final
model); the exporter writes its ``--out`` folder. A path with a file where a folder should be, a folder that cannot
be written, or a run.name that would put the run folder outside ``run.output_dir`` (or make it ``run.output_dir``
itself, which ``run.overwrite`` would then delete) is one UserError before any model loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from grpo_ds.errors import UserError
from grpo_ds.config.parse import printable


def check_output_folder(path: str | Path, where: str) -> None:
    """Raise UserError unless ``path`` is a writable folder, or can be created: the nearest part of it that exists
    is a writable folder (nothing on the way is a file)."""
    path = Path(path)
    shown = printable(str(path))
    if "\0" in str(path):
        raise UserError(where, f"{shown} holds a NUL character", "give a folder path")
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if existing == path:
        blocked = ""
    else:
        blocked = f"cannot be created: {printable(str(existing))} "
    if not existing.is_dir():
        kind = "a broken link" if existing.is_symlink() else "a file" if blocked else "not a folder"
        what = f"{blocked}is {kind}" if blocked else f"exists and is {kind}"
        raise UserError(where, f"{shown} {what}", "give a folder path, or move the file away")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(where, f"{shown} {blocked}is not writable", "give a folder you may write to (check its "
                        "permissions, and that the file system is not mounted read-only)")


def check_run_folder(output_dir: str, name: str) -> Path:
    """The run folder ``output_dir/name``, checked as an output folder; return it."""
    parts = Path(name).parts
    if not name.strip() or Path(name).is_absolute() or ".." in parts or all(p == "." for p in parts):
        raise UserError("run.name", f"{json.dumps(name)} is not a folder name inside run.output_dir (the run folder is "
                        "run.output_dir/run.name, which run.overwrite may delete)", 'give a name such as "grpo_1"')
    folder = Path(output_dir) / name
    check_output_folder(output_dir, "run.output_dir")
    check_output_folder(folder, "run.name")
    return folder
