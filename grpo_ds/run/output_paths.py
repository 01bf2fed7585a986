"""Every place a run writes, created and probed with a write before any model loads.

A run writes in the run folder ``run.output_dir/run.name`` and in folders inside it, each turned on
by a recipe key: its checkpoints, ``final_model``, the TensorBoard and W&B folders, the profile
folder and the ranks' logs (``places``). An output path that looks fine can still refuse a write: a
folder on a read-only mount or under /proc, a name longer than the file system allows, a folder made
immutable, a quota. Found only when the run first writes there, that was a traceback, minutes in. So
before anything loads, and before the run folder's lock is taken:

- ``inspect`` looks without writing (``grpo_ds.check``, the dry run, and every rank first thing in
  ``grpo_ds.train``, through grpo_ds.run.preflight): nothing on the way is a file, the nearest
  existing folder is writable, on a file system that is neither read-only nor one the kernel fills,
  and the names to be made fit it
  (grpo_ds.run.folder.check_output_folder);
- ``probe`` (rank 0 of a run, ``probe_on_rank_0``) inspects, then creates each missing folder and
  writes a probe file in each place (grpo_ds.run.writes.probe). Whatever happens, it leaves the file
  system as it found it: the probe files and every folder it made are removed again, the deepest
  first, so a failure leaves nothing half-made and a success leaves the folders to the writers (an
  empty ``checkpoints/`` left behind would read as a run to resume).

A failure is one UserError naming the key that decides the place, its path and the cause as the
operating system names it ("Read-only file system (EROFS)"), exit code 2. Every rank raises it: the
trainer's ranks through ``Dist.decide``, and under split placement the rollout ranks through the
launch's store, which the trainer's rank 0 serves.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import Dist
from grpo_ds.run import writes
from grpo_ds.run.checkpoint import CHECKPOINTS
from grpo_ds.run.folder import (
    cannot_write,
    check_output_folder,
    check_run_folder,
    folder_path,
    nearest_existing,
)

# <run folder>/ranks/rank<r>.jsonl, every rank's log (grpo_ds.train, grpo_ds.run.timeline)
RANKS = "ranks"
FINAL_MODEL = "final_model"  # run.save_final_model
TENSORBOARD = "tensorboard"  # logging.tensorboard (grpo_ds.run.metrics)
# logging.wandb_project: wandb.init(dir=<run folder>) writes here, online or offline
WANDB = "wandb"
# logging.profile_steps (grpo_ds.step.profiling.PROFILE_DIR; run/ does not import step/)
PROFILE = "profile"
# split placement: the trainer's rank 0 leaves the probe's outcome here
_STORE_KEY = "grpo_ds-output-probe"


@dataclass(frozen=True)
class Place:
    """A folder the run writes in, and the recipe key that decides it (named by the error when it
    cannot be)."""

    key: str
    path: Path


def places(recipe: Recipe) -> list[Place]:
    """Every folder this recipe's run writes in, parents before children: run.output_dir, the run
    folder, then the folders inside it that the recipe turns on."""
    run_dir, log = folder_path(recipe), recipe.logging
    wandb = log.wandb_project is not None and log.wandb_mode != "disabled"
    inside = [
        ("run.name", RANKS, True),
        # a preempted run saves one even with every_steps null
        ("checkpoint.every_steps", CHECKPOINTS, True),
        ("run.save_final_model", FINAL_MODEL, recipe.run.save_final_model),
        ("logging.tensorboard", TENSORBOARD, log.tensorboard),
        ("logging.wandb_project", WANDB, wandb),
        ("logging.profile_steps", PROFILE, log.profile_steps is not None),
    ]
    return [
        Place("run.output_dir", Path(recipe.run.output_dir)),
        Place("run.name", run_dir),
        *(Place(key, run_dir / name) for key, name, on in inside if on),
    ]


def inspect(recipe: Recipe) -> None:
    """Raise UserError for the first place that cannot be created or written in, as far as looking
    can tell; writes nothing."""
    # run.name's own rule, run.output_dir, the run folder
    check_run_folder(recipe.run.output_dir, recipe.run.name)
    for place in places(recipe)[2:]:
        check_output_folder(place.path, place.key)


def probe(recipe: Recipe) -> None:
    """Inspect, then create every place and write a probe file in it; raise UserError for the first
    that fails. The probe files and the folders made here are removed again, the deepest first, on
    success and on failure."""
    inspect(recipe)
    made: list[Path] = []
    try:
        for place in places(recipe):
            _create(place, made)
            failed = writes.probe(place.path)
            if failed is not None:
                raise cannot_write(place.key, place.path, place.path, failed)
    finally:
        for folder in reversed(made):
            try:
                os.rmdir(folder)
            except OSError:
                pass  # something else appeared in it meanwhile: not ours to remove


def probe_on_rank_0(recipe: Recipe, dist: Dist) -> None:
    """Every rank, before the lock and before any model loads: rank 0 of the launch probes
    (``probe``), and its failure is raised on every rank. Under split placement the trainer's rank 0
    probes and leaves the outcome in the launch's store, where the rollout ranks read it."""
    if dist.role == "rollout":
        failure = pickle.loads(dist.store.get(_STORE_KEY))
    else:
        failure = dist.decide(_probe_and_tell, recipe, dist.store)
    if failure is not None:
        raise failure


def _probe_and_tell(recipe: Recipe, store) -> Exception | None:
    """Rank 0: the probe's failure (None: every place is writable), also left in ``store`` for the
    rollout ranks of a split placement."""
    try:
        probe(recipe)
        failure = None
    except Exception as err:  # noqa: BLE001 - raised on every rank by probe_on_rank_0
        failure = err
    if store is not None:
        store.set(_STORE_KEY, pickle.dumps(failure))
    return failure


def _create(place: Place, made: list[Path]) -> None:
    """Make the missing folders of ``place`` from the nearest existing one down, recording each in
    ``made``."""
    existing = nearest_existing(place.path)
    missing = [place.path, *place.path.parents][: len(place.path.parts) - len(existing.parts)]
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as err:
            raise cannot_write(place.key, place.path, existing, err) from None
        made.append(folder)
