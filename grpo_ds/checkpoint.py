"""Atomic, verifiable checkpoints and exact resume.

Layout of a run folder's checkpoints (grpo_ds.export reads the same)::

    RUN_DIR/checkpoints/step_00000010/    one complete checkpoint
        ds/                               DeepSpeed's sharded engine state (engine.save_checkpoint, tag "ds";
                                          trainable weights only: a LoRA run's frozen base is not saved)
        rng/rank<r>.pt                    every rank's RNG states
        trainer_state.json                step, data sampler position, metric history
        manifest.json                     sha256 of every file above
    RUN_DIR/checkpoints/latest            the name of the newest complete checkpoint

A checkpoint is written into ``.tmp-step_...``; only when every rank has written its shards does rank 0
write the manifest, fsync the files and the folders, rename the folder to its final name and then
replace ``latest`` (write, fsync, rename). A crash at any moment therefore leaves either the previous
checkpoints untouched or the new one complete; a stale ``.tmp-`` folder is ignored and removed by the
next save. On resume the manifest is checked file by file: a damaged checkpoint (missing, truncated or
altered file) is reported by name and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo_ds.engine import Dist
from grpo_ds.errors import first_line

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
DS_TAG = "ds"
MANIFEST = "manifest.json"  # {"step": N, "files": {path relative to the checkpoint folder: sha256 hex}}
_STEP_FOLDER = re.compile(r"step_(\d+)")
# The files DeepSpeed's consolidation reads (zero_to_fp32 globs them); each must be covered by the manifest.
_SHARD_GLOBS = ("*_model_states.pt", "*_optim_states.pt")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Resumed:
    step: int  # the last completed step
    trainer_state: dict
    path: Path


# ------------------------------------------------------------------------------------------------- save

def save(policy, run_dir: Path, step: int, trainer_state: dict, keep: int, dist: Dist) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this: DeepSpeed's save is collective)."""
    root = run_dir / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / (TMP_PREFIX + final.name)
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    policy.save_state(tmp, DS_TAG)  # grpo_ds.policy.Policy: what a checkpoint holds of full and LoRA policies
    rng_file = tmp / "rng" / f"rank{dist.rank}.pt"
    rng_file.parent.mkdir(exist_ok=True)
    torch.save(_rng_state(), rng_file)
    _fsync_file(rng_file)
    dist.barrier()
    if dist.is_main:
        _write_json(tmp / "trainer_state.json", {"step": step, **trainer_state})
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in files:
            _fsync_file(p)
        _write_json(tmp / MANIFEST, {"step": step, "files": {
            str(p.relative_to(tmp)): _sha256(p) for p in files}})
        for folder in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: -len(p.parts)):
            _fsync_dir(folder)
        if final.exists():  # a checkpoint of this step from a run that crashed before moving on
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_text_atomic(root / LATEST, final.name)
        _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- load

@dataclass(frozen=True)
class StepFolder:
    step: int
    path: Path  # RUN_DIR/checkpoints/step_XXXXXXXX: complete unless damaged (``verify`` says which)


def step_folders(run_dir: Path) -> list[StepFolder]:
    """Every ``checkpoints/step_N`` folder of a run, oldest first; ``.tmp-`` folders (unfinished writes) are not
    listed. The one listing of a run's checkpoints: resume, pruning and grpo_ds.export all build on it."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_FOLDER.fullmatch(child.name)
        if match and child.is_dir():
            found.append(StepFolder(int(match.group(1)), child))
    return sorted(found, key=lambda f: f.step)


def latest_name(run_dir: Path) -> str | None:
    """The checkpoint folder name ``checkpoints/latest`` holds, or None when there is no pointer."""
    pointer = run_dir / CHECKPOINTS / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, newest first (the ``latest`` pointer's one first when it exists)."""
    found = [f.path for f in reversed(step_folders(run_dir))]
    name = latest_name(run_dir)
    found.sort(key=lambda p: p.name != name)  # stable: the pointed one first, the rest newest first
    return found


def verify(folder: str | Path) -> str | None:
    """None when every file listed in ``manifest.json`` is present with its sha256 (and the DeepSpeed shards are
    all listed); otherwise what is wrong, naming the file (relative to ``folder``)."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"{MANIFEST} is missing (an incomplete or foreign checkpoint)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"{MANIFEST} is not valid JSON ({first_line(err)})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return f'{MANIFEST} has no "files" object'
    match = _STEP_FOLDER.fullmatch(folder.name)
    if match and manifest.get("step") is not None and manifest["step"] != int(match.group(1)):
        return f"{MANIFEST} is for step {manifest['step']}, not step {int(match.group(1))}"
    for name, digest in sorted(files.items()):
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST} lists {name!r}, which is outside the checkpoint folder"
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} does not match its sha256 in {MANIFEST} (damaged or changed after saving)"
    shards = sorted(p for pattern in _SHARD_GLOBS for p in (folder / DS_TAG).glob(pattern))
    if not shards:
        return f"{DS_TAG}/ holds no DeepSpeed shards (*_model_states.pt, *_optim_states.pt)"
    for path in shards:
        name = path.relative_to(folder).as_posix()
        if name not in files:
            return f"{name} is not listed in {MANIFEST} (written after the checkpoint was completed?)"
    return None


def choose(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one message per damaged newer one."""
    damaged = []
    for path in complete_checkpoints(run_dir):
        problem = verify(path)
        if problem is None:
            return path, damaged
        damaged.append(f"checkpoint {path.name} is damaged: {problem}; using an older one")
    return None, damaged


def load(policy, path: Path, dist: Dist) -> Resumed:
    """Restore the policy (weights, optimizer, lr schedule), this rank's RNG states and the trainer state."""
    if not policy.load_state(path, DS_TAG):
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path / DS_TAG}")
    rng_file = path / "rng" / f"rank{dist.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        warnings.warn(f"{rng_file} is missing (saved with another world size?); RNG states not restored",
                      stacklevel=2)
    state = json.loads((path / "trainer_state.json").read_text())
    return Resumed(state["step"], state, path)


# ------------------------------------------------------------------------------------------------ files

def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")
    _fsync_file(path)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
