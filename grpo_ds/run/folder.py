"""The run folder: start fresh, resume, or refuse — decided before any model loads.

A folder that already holds a run (metrics or checkpoints) is replaced only with ``run.overwrite``.
With ``checkpoint.resume: "auto"`` it is continued when it holds the SAME recipe's run — the saved
recipe.json may differ only in keys that do not change the trajectory (run.overwrite, train.steps,
checkpoint.*, logging.*) — and refused when it holds another recipe's run, naming the first key that
differs. With ``"never"`` it is refused. ``resume`` may also name a checkpoint folder to start from.
A run that finished (its ``complete.json`` counts at least ``train.steps``) is left as it is: the
same command again does nothing, and a larger ``train.steps`` continues it.

Output folders are checked here too, by inspection only (nothing is written): each must be a
writable folder, or one that can be created, on a file system that is neither read-only nor one the
kernel fills (/proc, /sys). A run writes only inside its run folder ``run.output_dir/run.name``
(checkpoints, metrics, logs, traces, the final model); the exporter writes its ``--out`` folder. A
path with a file where a folder should be, a folder that cannot be written, or a run.name that would
put the run folder outside ``run.output_dir`` (or make it ``run.output_dir`` itself, which
``run.overwrite`` would then delete) is one UserError before any model loads.
grpo_ds.run.output_paths lists every place a run writes, and before a run starts creates each and
probes it with a write.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from grpo_ds.config.parse import printable
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed import launcher
from grpo_ds.errors import UserError
from grpo_ds.run import universal, writes
from grpo_ds.run.checkpoint import CHECKPOINTS, DS_TAG, complete_checkpoints, verify, write_error
from grpo_ds.run.lock import LOCK
from grpo_ds.run.prompts import data_changes

# Keys that may change between the attempts of one run (extending it, checkpointing or logging
# differently), and rollout.hf_compile(_timeout_s), which changes how fast the hf engine decodes,
# not what it samples (its default became "auto" on 2026-11-28: a run saved with "off" still
# resumes).
_MAY_DIFFER = (
    "run.overwrite",
    "run.preempt_grace_s",
    "train.steps",
    "checkpoint.",
    "logging.",
    "data.on_change",
    "rollout.hf_compile",
)
# what the run trains on (grpo_ds.run.prompts.data_identity), rewritten by every launch
DATA = "data.json"
COMPLETE = "complete.json"  # written when a run finishes: {"steps": N, "final_weights_sha256": ...}


@dataclass(frozen=True)
class RunFolder:
    path: Path
    fresh: bool  # wipe (if present) and start at step 1
    # resume from this checkpoint folder (None: from the newest good one, if any)
    checkpoint: Path | None
    # the folder holds this recipe's run, finished at train.steps: nothing to do
    completed_steps: int | None = None
    # how data.train changed since the run started (data.on_change "continue")
    data_changed: str | None = None


def folder_path(recipe: Recipe) -> Path:
    """The run folder: run.output_dir/run.name."""
    return Path(recipe.run.output_dir) / recipe.run.name


def decide(recipe: Recipe, data: dict | None = None) -> RunFolder:
    """Check the run folder against the recipe and, when it resumes, against ``data`` (the
    data_identity of data.train now); raise UserError when it must not be touched or its data
    changed (data.on_change "stop")."""
    path = folder_path(recipe)
    resume = recipe.checkpoint.resume
    explicit = None
    if resume not in ("auto", "never"):
        explicit = Path(resume)
        if not (explicit / "manifest.json").is_file():
            raise UserError(
                "checkpoint.resume",
                f"{explicit} is not a checkpoint folder (no manifest.json)",
                f'use "auto", "never", or a folder such as {path / CHECKPOINTS / "step_00000050"}',
            )
        problem = verify(explicit)
        if problem:
            raise UserError(
                "checkpoint.resume", f"the checkpoint is damaged: {problem}", "pick another one"
            )
    holds_run = (path / "metrics.jsonl").exists() or (path / CHECKPOINTS).exists()
    if not holds_run or recipe.run.overwrite:
        return RunFolder(path, True, explicit)
    if resume == "never":
        raise UserError(
            "run.name",
            f"the run folder {path} already holds a run",
            "choose another run.name, delete the folder, set run.overwrite=true, or set "
            'checkpoint.resume="auto" to continue it',
        )
    difference = _first_difference(path / "recipe.json", recipe.to_dict())
    if difference:
        raise UserError(
            "run.name",
            f"the run folder {path} holds another recipe's run ({difference})",
            "choose another run.name, or set run.overwrite=true to replace it",
        )
    completed = completed_steps(path)
    if explicit is None and completed is not None and completed >= recipe.train.steps:
        return RunFolder(path, False, None, completed)
    changed = _data_changed(path, data) if data is not None else None
    if changed and recipe.data.on_change == "stop":
        raise UserError(
            "data.train",
            f"changed since the run in {path} started: {changed}",
            'restore it, or set data.on_change="continue" to go on with the changed data (a new '
            "pass over it begins), or start another run (run.name)",
        )
    return RunFolder(path, False, explicit, data_changed=changed)


def check_world_size(folder: RunFolder, recipe: Recipe, ds_config: dict, world_size: int) -> None:
    """Before anything loads: a resume on another world size than its checkpoint's goes through
    DeepSpeed's universal checkpoint (grpo_ds.run.universal), which this layout may not take; then
    one UserError says so."""
    if folder.fresh:
        return
    found = (
        [folder.checkpoint]
        if folder.checkpoint is not None
        else complete_checkpoints(folder.path)[:1]
    )
    saved = universal.saved_world_size(found[0], DS_TAG) if found else None
    if (
        saved is None
        or saved == world_size
        or (problem := universal.layout_problem(recipe, ds_config)) is None
    ):
        return
    raise UserError(
        "world size",
        f"the run in {folder.path} was checkpointed at world size {saved} and resumes at "
        f"{world_size}, which {problem} cannot do (a ZeRO "
        "data-parallel layout resumes at any world size)",
        f"resume it on {saved} ranks",
    )


def _data_changed(path: Path, now: dict) -> str | None:
    """How the data changed since the run in ``path`` recorded it (None: unchanged, or a run from
    before data.json)."""
    try:
        before = json.loads((path / DATA).read_text())
    except (OSError, ValueError):
        return None
    return data_changes(before, now)


def completed_steps(path: Path) -> int | None:
    """The steps of the run that finished in ``path`` (its COMPLETE record), None if none finished
    there."""
    try:
        return int(json.loads((path / COMPLETE).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_complete(path: Path, steps: int, final_weights_sha256: str) -> None:
    """Rank 0, at the end of a run: record that it finished (running the same command again does
    nothing)."""
    record = {"steps": steps, "final_weights_sha256": final_weights_sha256}
    writes.write_atomic(path / COMPLETE, json.dumps(record) + "\n")


def prepare(folder: RunFolder, recipe: Recipe, ds_config: dict, data: dict | None = None) -> None:
    """Rank 0: wipe a replaced run and write the recipe, the resolved DeepSpeed config and what the
    run trains on."""
    try:
        _write_run_files(folder, recipe, ds_config)
        if data is not None:
            writes.write_atomic(folder.path / DATA, json.dumps(data, indent=2) + "\n")
    # rank 0 (train.py runs it through Dist.decide): the error reaches every rank
    except OSError as err:
        raise write_error(folder.path, "run folder", err) from None


def _write_run_files(folder: RunFolder, recipe: Recipe, ds_config: dict) -> None:
    if folder.fresh and folder.path.exists():
        if (folder.path / "metrics.jsonl").exists() or (folder.path / CHECKPOINTS).exists():
            launcher.say(
                f"replacing the run folder {folder.path} (run.overwrite is true): "
                f"{_held(folder.path)} deleted"
            )
        # all of it but the lock this launch holds (grpo_ds.run.lock)
        for child in folder.path.iterdir():
            if child.name == LOCK:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    folder.path.mkdir(parents=True, exist_ok=True)
    writes.write_atomic(folder.path / "recipe.json", json.dumps(recipe.to_dict(), indent=2) + "\n")
    writes.write_atomic(folder.path / "deepspeed.json", json.dumps(ds_config, indent=2) + "\n")


def trim_metrics(path: Path, last_step: int) -> None:
    """Rank 0: keep metrics.jsonl's records up to ``last_step`` (a crashed attempt may have logged
    steps past its last checkpoint); a torn last line is dropped."""
    trim_log(path / "metrics.jsonl", last_step)


def trim_log(log: Path, last_step: int) -> None:
    """Keep a JSON-lines log's records of steps up to ``last_step``; records of later steps, records
    without a step (the end of an earlier attempt) and a torn last line are dropped. A rank trims
    its own log."""
    if not log.exists():
        return
    kept = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] <= last_step
        ):
            kept.append(line)
    try:
        writes.write_atomic(log, "".join(line + "\n" for line in kept))
    except OSError as err:
        raise UserError(
            "resume",
            f"cannot write {err.filename}: {writes.describe(err)}",
            f"the checkpoint is untouched: {writes.remedy(err)} and run the same command again",
        ) from None


def _held(path: Path) -> str:
    """What a run folder about to be replaced holds, for the notice: its checkpoints and logged
    steps."""
    folders = sorted((path / CHECKPOINTS).glob("step_*"))
    try:
        logged = sum(1 for _ in (path / "metrics.jsonl").open())
    except OSError:
        logged = 0
    held = f"{len(folders)} checkpoint(s)" + (f" (newest {folders[-1].name})" if folders else "")
    return f"{held} and the metrics of {logged} step(s)"


def _first_difference(saved_path: Path, current: dict) -> str | None:
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError):
        return f"its {saved_path.name} is missing or unreadable"
    flat_saved, flat_now = _flatten(saved), _flatten(current)
    defaults = _flatten(Recipe().to_dict())
    for key in sorted(set(flat_saved) | set(flat_now)):
        if key.startswith(_MAY_DIFFER) or key in _MAY_DIFFER:
            continue
        if key not in flat_saved and key in defaults and flat_now.get(key) == defaults[key]:
            # a key added since an older grpo_ds wrote that recipe, at its default: the same run
            continue
        if flat_saved.get(key) != flat_now.get(key):
            return (
                f"{key} was {json.dumps(flat_saved.get(key))}, "
                f"the recipe says {json.dumps(flat_now.get(key))}"
            )
    return None


def _flatten(recipe: dict) -> dict:
    out = {}
    for section, value in recipe.items():
        if isinstance(value, dict) and section != "deepspeed":
            out.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            out[section] = value
    return out


# ------------------------------------------------------------ output folders, before anything loads

# File systems the kernel fills (mounted on /proc, /sys, ...): nothing a run writes can live there,
# and some take a mkdir as an order (cgroup makes a group), so such a place is refused without
# trying.
SPECIAL_FILE_SYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "efivarfs",
        "fusectl",
        "selinuxfs",
        "binfmt_misc",
        "autofs",
        "mqueue",
        "devpts",
        "rpc_pipefs",
        "nsfs",
    }
)


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists (a broken link counts), else its nearest parent that does."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_output_folder(path: str | Path, where: str) -> None:
    """Raise UserError unless ``path`` is a writable folder, or can be created: the nearest part of
    it that exists is a writable folder (nothing on the way is a file), on a file system that is
    neither read-only nor one the kernel fills (/proc, /sys), and every part still to be made is a
    name the file system allows. Inspects only: writes nothing (the dry run's check;
    grpo_ds.run.output_paths probes with a write before a run starts)."""
    path = Path(path)
    shown = printable(str(path))
    if "\0" in str(path):
        raise UserError(where, f"{shown} holds a NUL character", "give a folder path")
    existing = nearest_existing(path)
    if existing == path:
        blocked = ""
    else:
        blocked = f"cannot be created: {printable(str(existing))} "
    if not existing.is_dir():
        kind = "a broken link" if existing.is_symlink() else "a file" if blocked else "not a folder"
        what = f"{blocked}is {kind}" if blocked else f"exists and is {kind}"
        raise UserError(where, f"{shown} {what}", "give a folder path, or move the file away")
    special = _special_mount(existing)
    if special:
        fs_type, mount = special
        on = "" if os.path.realpath(existing) == mount else f"on {printable(mount)}, "
        raise UserError(
            where,
            f"{shown} {blocked}is {on}a {fs_type} file system that the kernel fills",
            "give a folder on a disk",
        )
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        # bytes in one name (255 on most file systems)
        longest = os.pathconf(existing, "PC_NAME_MAX")
        longest_path = os.pathconf(existing, "PC_PATH_MAX")  # bytes in a whole path (4096 on Linux)
    except (OSError, ValueError):  # a file system that does not say: the probe write finds out
        read_only, longest, longest_path = False, -1, -1
    if read_only:
        raise cannot_write(where, path, existing, OSError(errno.EROFS, os.strerror(errno.EROFS)))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            where,
            f"{shown} {blocked}is not writable",
            "give a folder you may write to (check its "
            "permissions, and that the file system is not mounted read-only)",
        )
    too_long = longest_path > 0 and len(os.fsencode(os.path.abspath(path))) >= longest_path
    if (
        too_long
        or longest > 0
        and any(len(os.fsencode(part)) > longest for part in path.relative_to(existing).parts)
    ):
        raise cannot_write(
            where, path, existing, OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        )


def cannot_write(where: str, path: Path, existing: Path, err: OSError) -> UserError:
    """The one line for an output folder ``path`` that cannot be created (``existing``, the nearest
    part of it that exists, is another folder) or written in, for the cause ``err`` as the operating
    system names it. The dry run's inspection and the probe before a run (grpo_ds.run.output_paths)
    word the same cause the same way."""
    doing = "cannot be written in" if existing == path else "cannot be created"
    return UserError(
        where,
        f"{printable(str(path))} {doing}: {writes.describe(err)}",
        f"{writes.remedy(err)}, or give another folder",
    )


def _special_mount(folder: Path) -> tuple[str, str] | None:
    """(file system type, mount point) when ``folder`` lies on a file system the kernel fills
    (/proc, /sys, a cgroup), else None; read from /proc/self/mountinfo (None where it cannot be
    read)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real, found = os.path.realpath(folder), None
    for line in lines:
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        # \040 is a space
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        fs_type = fields[fields.index("-") + 1]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        # the deepest mount holding it (the last wins)
        if inside and (found is None or len(mount) >= len(found[1])):
            found = (fs_type, mount)
    return found if found is not None and found[0] in SPECIAL_FILE_SYSTEMS else None


def check_run_folder(output_dir: str, name: str) -> Path:
    """The run folder ``output_dir/name``, checked as an output folder; return it."""
    parts = Path(name).parts
    if (
        not name.strip()
        or Path(name).is_absolute()
        or ".." in parts
        or all(p == "." for p in parts)
    ):
        raise UserError(
            "run.name",
            f"{json.dumps(name)} is not a folder name inside run.output_dir (the run folder is "
            "run.output_dir/run.name, which run.overwrite may delete)",
            'give a name such as "grpo_1"',
        )
    folder = Path(output_dir) / name
    check_output_folder(output_dir, "run.output_dir")
    check_output_folder(folder, "run.name")
    return folder
