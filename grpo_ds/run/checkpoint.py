"""Atomic, verifiable checkpoints and exact resume.

Layout of a run folder's checkpoints (grpo_ds.export reads the same)::

    RUN_DIR/checkpoints/step_00000010/    one complete checkpoint
        ds/                               DeepSpeed's sharded engine state (engine.save_checkpoint,
                                          tag "ds"; trainable weights only: a LoRA run's frozen base
                                          is not saved)
        rng/rank<r>.pt                    every rank's RNG states
        trainer_state.json                step, data sampler position, metric history
        manifest.json                     sha256 of every file above
    RUN_DIR/checkpoints/latest            the name of the newest complete checkpoint

A checkpoint is written into ``.tmp-step_...``; only when every rank has written its shards does
rank 0 write the manifest, fsync the files and the folders, rename the folder to its final name and
then replace ``latest`` (write, fsync, rename). A crash at any moment therefore leaves either the
previous checkpoints untouched or the new one complete; a stale ``.tmp-`` folder is ignored and
removed by the next save. On resume the manifest is checked file by file, and each PyTorch file's
zip structure read (grpo_ds.model.weight_files: a file saved cut short matches its sha256): a
damaged checkpoint (a missing, truncated, altered or unreadable file) is reported by name and the
previous one is used, or, named by checkpoint.resume, refused (grpo_ds.run.folder). A file that
still fails to load is one line naming it.

A write that fails on any rank (a full disk, a read-only file system, an exceeded quota) stops every
rank with one error naming the file, the cause and the last good checkpoint (grpo_ds.run.writes);
the unfinished folder is removed and ``latest`` still names the previous checkpoint, so the same
command resumes from it once the disk is fixed. Before anything is written, a checkpoint larger than
the free space is refused the same way: its expected size is the previous checkpoint's, or
``bytes_per_parameter`` per trainable parameter for the first, plus writes.SPACE_MARGIN.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import Dist
from grpo_ds.errors import UserError, first_line
from grpo_ds.model.weight_files import FILE_ERRORS, file_problem, is_damaged_file_error
from grpo_ds.run import universal, writes

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
DS_TAG = "ds"
# {"step": N, "files": {path relative to the checkpoint folder: sha256 hex}}
MANIFEST = "manifest.json"
_STEP_FOLDER = re.compile(r"step_(\d+)")
# The files DeepSpeed's consolidation reads (zero_to_fp32 globs them); each must be covered by the
# manifest.
_SHARD_GLOBS = ("*_model_states.pt", "*_optim_states.pt")
# The size of a first checkpoint, per trainable parameter: ZeRO's fp32 master weights and Adam's two
# moments; under ZeRO stages 0-2 the module's own weights too (bytes_per_parameter).
BYTES_PER_PARAMETER = 12


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Resumed:
    step: int  # the last completed step
    trainer_state: dict
    path: Path


# --------------------------------------------------------------------------------------------- save


def save(policy, run_dir: Path, step: int, trainer_state: dict, keep: int, dist: Dist) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this: DeepSpeed's save is collective).

    A failed write on any rank (a full disk, a read-only file system, a quota), or less free space
    than the checkpoint needs, is one UserError raised on every rank naming the file, the cause and
    the last good checkpoint; the unfinished folder is removed and the previous checkpoints are
    untouched."""
    root = run_dir / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / (TMP_PREFIX + final.name)
    where = f"checkpoint step {step}"
    dist.decide(_start, run_dir, tmp, policy, where)
    failure = None
    try:
        _write_shards(policy, tmp, dist)
    except OSError as err:
        failure = write_error(run_dir, where, err)
    except Exception as err:  # noqa: BLE001 - raised on every rank by agree, so that none waits for this one
        failure = err
    try:
        writes.agree(dist, failure)
    except Exception:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        # no rank exits (and has the launcher stop the others) before the folder is gone
        dist.barrier()
        raise
    # the world size: grpo_ds.run.universal
    state = {"step": step, "world_size": dist.world_size, **trainer_state}
    dist.decide(_finish, run_dir, tmp, final, state, keep, where)  # also the barrier
    return final


def _start(run_dir: Path, tmp: Path, policy, where: str) -> None:
    """Rank 0: remove unfinished folders, refuse a checkpoint the free space cannot hold, create the
    folders."""
    root = tmp.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP_PREFIX + "*"):  # unfinished writes of crashed or failed attempts
            shutil.rmtree(stale, ignore_errors=True)
        previous = complete_checkpoints(run_dir)
        if previous:
            expected, how = _folder_bytes(previous[0]), f"the size of {previous[0].name}"
        else:
            params, per = _trainable_parameters(policy), bytes_per_parameter(policy)
            expected, how = params * per, f"{params:,} trainable parameters x {per} B"
        writes.check_space(
            where,
            root,
            int(expected * (1 + writes.SPACE_MARGIN)),
            f"the checkpoint ({how}, plus {writes.SPACE_MARGIN:.0%})",
            resume_fix(run_dir, "free space"),
        )
        # made here, so that no rank's own mkdir can fail inside DeepSpeed's save
        for sub in (DS_TAG, "rng"):
            (tmp / sub).mkdir(parents=True)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(run_dir, where, err) from None


def _write_shards(policy, tmp: Path, dist: Dist) -> None:
    """Every rank: its DeepSpeed shards and its RNG states; a failed write is raised after
    DeepSpeed's save ended."""
    with _deepspeed_writes_recorded(policy.engine, dist, tmp) as failures:
        # grpo_ds.model.policy.Policy: what a checkpoint holds of full and LoRA policies
        policy.save_state(tmp, DS_TAG)
    if failures:
        raise failures[0]
    rng_file = tmp / "rng" / f"rank{dist.rank}.pt"
    with writes.writing(rng_file):
        torch.save(_rng_state(), rng_file)
        writes.fsync_file(rng_file)


@contextmanager
def _deepspeed_writes_recorded(engine, dist: Dist, tmp: Path) -> Iterator[list[OSError]]:
    """DeepSpeed's save_checkpoint runs collectives after its writes (ZeRO-3 all-gathers its
    persistent parameters, then every rank meets in a barrier): a rank whose write raised would
    leave the others waiting there. Its writes (the shards, the recovery scripts) record their
    failure in the yielded list instead, to be raised once every rank has finished the save. The one
    write outside them, rank 0's ``latest`` tag file, comes just before the final barrier (DeepSpeed
    0.19): a rank 0 failing there joins that barrier, then records the failure."""
    failures: list[OSError] = []
    writer, save_shard, copy_scripts = (
        engine.checkpoint_engine,
        engine.checkpoint_engine.save,
        engine._copy_recovery_script,
    )

    def recorded_save(state_dict, path):
        try:
            with writes.writing(path):
                save_shard(state_dict, path)
        except OSError as err:
            failures.append(err)

    def recorded_copy(save_path):
        try:
            with writes.writing(Path(save_path) / "zero_to_fp32.py"):
                copy_scripts(save_path)
        except OSError as err:
            failures.append(err)

    writer.save, engine._copy_recovery_script = recorded_save, recorded_copy
    try:
        with writes.writing(tmp / LATEST):
            yield failures
    except OSError as err:
        dist.barrier()
        failures.append(err)
    finally:
        del writer.save, engine._copy_recovery_script  # the class's methods again


def _finish(
    run_dir: Path, tmp: Path, final: Path, trainer_state: dict, keep: int, where: str
) -> None:
    """Rank 0: trainer state, manifest, fsync, rename into place, point ``latest`` at it, prune. On
    a failed write the new folder is removed (renamed or not) and ``latest`` no longer names it."""
    root = final.parent
    try:
        _write_json(tmp / "trainer_state.json", trainer_state)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        _write_json(
            tmp / MANIFEST,
            {
                "step": trainer_state["step"],
                "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
            },
        )
        # fsynced and renamed into place; a final of this step is one from a run that crashed before
        # moving on
        writes.publish_folder(tmp, final)
        writes.write_atomic(root / LATEST, final.name + "\n")
    except OSError as err:
        renamed = not tmp.exists()  # only the rename into place removes it
        shutil.rmtree(tmp, ignore_errors=True)
        if renamed:
            _unpublish(final)
        raise write_error(run_dir, where, err) from None
    _prune(root, keep)


def _unpublish(final: Path) -> None:
    """Remove a checkpoint folder whose publication failed, and a ``latest`` pointer that already
    names it."""
    shutil.rmtree(final, ignore_errors=True)
    pointer = final.parent / LATEST
    try:
        pointer.with_name(pointer.name + ".tmp").unlink(missing_ok=True)
        if latest_name(final.parent.parent) == final.name:
            pointer.unlink()
    # the write that failed may fail again here; complete_checkpoints skips a dangling pointer
    except OSError:
        pass


def write_error(run_dir: Path, where: str, err: OSError) -> UserError:
    """The one-line error of a failed write into a run folder: the file, the cause and the last good
    checkpoint."""
    return UserError(
        where,
        f"cannot write {err.filename or run_dir}: {writes.describe(err)}",
        resume_fix(run_dir, writes.remedy(err)),
    )


def resume_fix(run_dir: Path, remedy: str) -> str:
    """ "the last good checkpoint is ...; <remedy> and run the same command to resume from it" """
    good = complete_checkpoints(run_dir)
    if not good:
        return f"the run has no checkpoint yet; {remedy} and run the same command to start it again"
    return (
        f"the last good checkpoint is {good[0]}; {remedy} "
        "and run the same command to resume from it"
    )


@contextmanager
def run_file_writes(dist: Dist, run_dir: Path, where: str) -> Iterator[None]:
    """Writes of run files (metrics, samples, rank logs) on some or all ranks, with no collective
    inside: a write that failed on any rank is one error (``write_error``) raised on every rank once
    all have left the block."""
    failure = None
    try:
        yield
    except OSError as err:
        failure = write_error(run_dir, where, err)
    except Exception as err:  # noqa: BLE001 - raised on every rank by agree, so that none waits for this one
        failure = err
    writes.agree(dist, failure)


def _trainable_parameters(policy) -> int:
    """What a checkpoint saves: the trainable parameters (ZeRO-3's ``ds_numel``: the whole tensor,
    not a shard)."""
    return sum(
        getattr(p, "ds_numel", p.numel())
        for p in policy.engine.module.parameters()
        if p.requires_grad
    )


def bytes_per_parameter(policy) -> int:
    """A checkpoint's bytes per trainable parameter: BYTES_PER_PARAMETER, plus the module's weights
    in their dtype where the model-states file holds them whole (ZeRO stages 0-2; ZeRO-3's
    partitioned module saves no weights)."""
    engine = policy.engine
    if engine.zero_optimization_stage() == 3:
        return BYTES_PER_PARAMETER
    return BYTES_PER_PARAMETER + next(
        p.element_size() for p in engine.module.parameters() if p.requires_grad
    )


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------- load


@dataclass(frozen=True)
class StepFolder:
    step: int
    path: Path  # RUN_DIR/checkpoints/step_XXXXXXXX: complete unless damaged (``verify`` says which)


def step_folders(run_dir: Path) -> list[StepFolder]:
    """Every ``checkpoints/step_N`` folder of a run, oldest first; ``.tmp-`` folders (unfinished
    writes) are not listed. The one listing of a run's checkpoints: resume, pruning and
    grpo_ds.export all build on it."""
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
    """Complete checkpoint folders, newest first (the ``latest`` pointer's one first when it
    exists)."""
    found = [f.path for f in reversed(step_folders(run_dir))]
    name = latest_name(run_dir)
    found.sort(key=lambda p: p.name != name)  # stable: the pointed one first, the rest newest first
    return found


def verify(folder: str | Path) -> str | None:
    """None when every file listed in ``manifest.json`` is present with its sha256 (and the
    DeepSpeed shards are all listed); otherwise what is wrong, naming the file (relative to
    ``folder``)."""
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
            return (
                f"{name} does not match its sha256 in {MANIFEST} (damaged or changed after saving)"
            )
        if path.suffix == ".pt" and (problem := file_problem(path)):
            return f"{name} {problem}; it matches its sha256 in {MANIFEST}: it was saved so"
    shards = sorted(p for pattern in _SHARD_GLOBS for p in (folder / DS_TAG).glob(pattern))
    if not shards:
        return f"{DS_TAG}/ holds no DeepSpeed shards (*_model_states.pt, *_optim_states.pt)"
    for path in shards:
        name = path.relative_to(folder).as_posix()
        if name not in files:
            return (
                f"{name} is not listed in {MANIFEST} (written after the checkpoint was completed?)"
            )
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
    """Restore the policy (weights, optimizer, lr schedule), this rank's RNG states and the trainer
    state. A checkpoint of another world size is loaded through DeepSpeed's universal checkpoint
    (grpo_ds.run.universal), made by rank 0 the first time; its ranks' RNG states do not map onto
    this world size, and need not: a sample's draws are keyed by the step and its place in the step
    (grpo_ds.rollout.streams)."""
    saved = universal.saved_world_size(path, DS_TAG)
    tag = DS_TAG
    if saved is not None and saved != dist.world_size:
        dist.decide(universal.ensure, path, DS_TAG)
        launcher.say(
            f"note: the checkpoint {path.name} was written by {saved} ranks; loading it on "
            f"{dist.world_size} through DeepSpeed's universal "
            f"checkpoint ({path.name}/{universal.UNIVERSAL_TAG})"
        )
        tag = universal.UNIVERSAL_TAG
    with (
        _damage_named(path, path / tag),
        universal.loading(policy.engine) if tag != DS_TAG else contextlib.nullcontext(),
    ):
        if not policy.load_state(path, tag):
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path / tag}")
    rng_file = path / "rng" / f"rank{dist.rank}.pt"
    if rng_file.is_file() and tag == DS_TAG:
        with _damage_named(path, rng_file):
            rng_state = torch.load(rng_file, weights_only=False)
        _set_rng_state(rng_state)
    elif tag == DS_TAG:
        warnings.warn(f"{rng_file} is missing; RNG states not restored", stacklevel=2)
    state = json.loads((path / "trainer_state.json").read_text())
    return Resumed(state["step"], state, path)


@contextmanager
def _damage_named(checkpoint: Path, read: Path) -> Iterator[None]:
    """A load of ``read`` (a file or a folder of PyTorch files) that fails on a damaged file
    (weight_files.is_damaged_file_error: verified, yet damaged inside a whole archive) as one
    UserError naming the first file under ``read`` whose structure is damaged, else ``read`` and the
    loader's error; any other error as it is."""
    try:
        yield
    except (RuntimeError, *FILE_ERRORS) as err:
        if not is_damaged_file_error(err):
            raise
        files = sorted(read.rglob("*.pt")) if read.is_dir() else [read]
        named = next((f"{f} {problem}" for f in files if (problem := file_problem(f))), None)
        raise UserError(
            f"checkpoint {checkpoint.name}",
            named or f"{read} cannot be loaded ({first_line(err)})",
            "resume from an older checkpoint: set checkpoint.resume to its folder (python -m "
            "grpo_ds.export RUN_DIR --list verifies them)",
        ) from None


# -------------------------------------------------------------------------------------------- files


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


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


def _write_json(path: Path, obj: dict) -> None:
    with writes.writing(path):
        # fsynced with the whole folder (writes.publish_folder)
        path.write_text(json.dumps(obj, indent=1) + "\n")
