"""Hugging Face Hub ids wherever a model or a dataset is named: ``model.path``,
``reward.models[].path``, ``data.train`` and ``eval.data`` may each name a repository on the Hub
("owner/name") instead of a local path.

An id is a string that names no local path (a local folder or file of that name wins) and reads as
``owner/name``: letters, digits, "-", "_" and ".", neither "--" nor ".."; a dataset name that ends
in .jsonl, .json or .parquet is a file's. ``builtin:`` names are neither.

An id is read from huggingface_hub's cache (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``) at the
revision its key names (``model.revision``, ``reward.models[].revision``, ``data.train_revision``,
``eval.data_revision``; null: the default branch); what the cache lacks is downloaded, unless
``HF_HUB_OFFLINE=1``. A model takes its config, tokenizer and code files and its top-level weights
in one format (safetensors, else PyTorch's .bin); the dry run (grpo_ds.check) takes all but the
weights. A dataset takes the files grpo_ds.run.hub_data picks. The run then reads the snapshot
folder as it reads a local one (``Recipe.to_dict``, the run folder's recipe.json, keeps the id).

Once per node: under a launcher (LOCAL_SIZE > 1) the node's local rank 0 fetches, holding a lock
file in the cache (beside huggingface_hub's own, in .locks/grpo_ds/), then writes a marker there:
the folder, or its one-line refusal, which the node's other ranks, waiting for the marker, return
or raise too. A marker counts when it was written after this rank's launcher (its parent process:
the node's ranks are its children) started, so one an earlier launch left is never read. A rank
that finds no marker after ``ALONE_AFTER_S`` with the lock free, or cannot tell a fresh marker (no
/proc) or write one, fetches for itself: a launcher of another shape costs a second look at the
cache, never a hang.

huggingface_hub draws its progress bars where stderr is a terminal; a log gets none. Every failure
is one UserError at the key that named the id: no such repository (or a private one without a
token), a gated one without access, an unknown revision, the cache without it while offline
(``HF_HUB_OFFLINE=1``) or while the Hub cannot be reached, and a cache that cannot be written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_ds.config.parse import printable
from grpo_ds.distributed import launcher
from grpo_ds.errors import UserError, first_line
from grpo_ds.model.weight_files import SAFETENSORS, SAFETENSORS_INDEX, WEIGHT_NAMES
from grpo_ds.run.writes import describe, remedy, write_atomic

# one part of an id, owner or name, as huggingface_hub's validate_repo_id takes it
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(f"{_PART}/{_PART}")
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# a model folder besides its weights: configs, tokenizer files, a chat template, remote code
MODEL_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")
# a model's subfolders (ONNX exports, original checkpoints): transformers reads the top level only
_MODEL_SUBFOLDERS = ["*/*"]
POLL_S = 0.2  # how often a waiting rank looks for the marker
ALONE_AFTER_S = 60.0  # a waiting rank that finds no marker and the lock free then fetches itself


@dataclass(frozen=True)
class HubRepo:
    """A repository on the Hugging Face Hub that a recipe key names by its id."""

    where: str  # the key naming it: "model.path", "reward.models[0].path", "data.train"
    repo_id: str  # "owner/name"
    kind: str  # "model" or "dataset"
    revision: str | None  # a branch, tag or commit; None: the default branch
    revision_key: str  # the key of its revision: "model.revision", ...

    @property
    def local(self) -> str:
        """The local path the id would otherwise be: "local folder", "local file or folder"."""
        return "local folder" if self.kind == "model" else "local file or folder"


def hub_repo(
    where: str,
    spec: str,
    kind: str,
    revision: str | None,
    revision_key: str,
    source_dir: str | None = None,
) -> HubRepo | None:
    """``spec`` as a Hub repository of ``kind``, or None when it names a local path (in the
    working directory, or in ``source_dir``) or a builtin. A revision for anything but an id is
    refused: it would pick nothing."""
    if _is_hub_id(spec, kind, source_dir):
        return HubRepo(where, spec, kind, revision, revision_key)
    if revision is not None:
        raise UserError(
            revision_key,
            f"{revision!r} picks a revision of a Hugging Face Hub repository, but {where} "
            f"{printable(spec)} is not a Hub id",
            f"set {revision_key} to null for a local path or a builtin",
        )
    return None


def _is_hub_id(spec: str, kind: str, source_dir: str | None) -> bool:
    if REPO_ID.fullmatch(spec) is None or "--" in spec or ".." in spec:
        return False
    if kind == "dataset" and spec.lower().endswith(DATA_FILE_SUFFIXES):
        return False  # a file's name
    local = [Path(spec)] + ([Path(source_dir) / spec] if source_dir else [])
    return not any(path.exists() for path in local)


def hub_model(
    where: str, path: str, revision: str | None, revision_key: str, weights: bool = True
) -> Path | None:
    """The cache folder of the model ``path`` names by its Hub id, fetched once per node: its
    config, tokenizer and code files, and with ``weights`` its weights too; None when ``path`` is a
    local folder or a builtin."""
    repo = hub_repo(where, path, "model", revision, revision_key)
    if repo is None:
        return None
    return once_per_node(repo, f"weights {weights}", lambda: _fetch_model(repo, weights))


def _fetch_model(repo: HubRepo, weights: bool) -> Path:
    if not weights:
        return snapshot(repo, MODEL_FILES)
    folder = snapshot(repo, (*MODEL_FILES, "*.safetensors"))
    if not any((folder / name).is_file() for name in (SAFETENSORS, SAFETENSORS_INDEX)):
        # no safetensors: PyTorch's files, of the same commit
        folder = snapshot(repo, (*MODEL_FILES, "*.bin"), revision=folder.name)
    if offline() and not any((folder / name).is_file() for name in WEIGHT_NAMES):
        raise not_cached(repo, "without its weights")
    return folder


def snapshot(repo: HubRepo, patterns: Sequence[str] | None, revision: str | None = None) -> Path:
    """The files of ``repo`` that match ``patterns`` (None: every file) at ``revision`` (default:
    the repository's), from the cache or downloaded into it: their snapshot folder."""
    from huggingface_hub import snapshot_download

    try:
        with progress_bars():
            folder = snapshot_download(
                repo.repo_id,
                repo_type=repo.kind,
                revision=revision or repo.revision,
                allow_patterns=list(patterns) if patterns is not None else None,
                ignore_patterns=_MODEL_SUBFOLDERS if repo.kind == "model" else None,
            )
    except OSError as err:  # huggingface_hub's errors are OSErrors, a full disk's too
        raise hub_error(repo, err) from None
    return Path(folder)


def hub_file(repo: HubRepo, filename: str) -> Path | None:
    """One file of ``repo``, from the cache or downloaded into it; None when the repository holds
    no file of that name."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        with progress_bars():
            return Path(
                hf_hub_download(repo.repo_id, filename, repo_type=repo.kind, revision=repo.revision)
            )
    except LocalEntryNotFoundError as err:  # not cached: not the same as not there
        raise hub_error(repo, err) from None
    except EntryNotFoundError:
        return None
    except OSError as err:
        raise hub_error(repo, err) from None


def offline() -> bool:
    """Whether huggingface_hub may not reach the Hub (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


# ----------------------------------------------------------------------------------------- errors


def hub_error(repo: HubRepo, err: OSError) -> UserError:
    """huggingface_hub's error while fetching ``repo`` as the one line a user can act on."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name, kind = repo.repo_id, repo.kind
    if isinstance(err, GatedRepoError):  # a RepositoryNotFoundError too
        return UserError(
            repo.where,
            f"{name} is a gated {kind} on the Hugging Face Hub, and no token with access to it "
            "was given",
            "accept its conditions on its Hub page, then log in with `hf auth login` or set "
            "HF_TOKEN",
        )
    if isinstance(err, RepositoryNotFoundError):
        return UserError(
            repo.where,
            f"{name} is not a {repo.local}, and the Hugging Face Hub has no {kind} of that name "
            "(or it is private, and no token given may read it)",
            f"give a {repo.local}, or the Hub id of a {kind} as owner/name (a private one needs "
            "`hf auth login` or HF_TOKEN)",
        )
    if isinstance(err, RevisionNotFoundError):
        return UserError(
            repo.revision_key,
            f"{repo.revision!r} is not a branch, tag or commit of the {kind} {name} on the "
            "Hugging Face Hub",
            "give one of its branches or tags or a commit hash, or null for its default branch",
        )
    if isinstance(err, (LocalEntryNotFoundError, ConnectionError)):
        return not_cached(repo, "", err)
    if isinstance(err, HfHubHTTPError):
        return UserError(
            repo.where,
            f"the Hugging Face Hub refused {name} ({first_line(err)})",
            "check HF_TOKEN and HF_ENDPOINT, or try again later",
        )
    return UserError(
        repo.where,
        f"cannot fetch {name} into the Hugging Face cache {_cache()} ({describe(err)})",
        f"{remedy(err)}, or set HF_HOME to a folder with room that you can write in",
    )


def not_cached(repo: HubRepo, how: str, err: BaseException | None = None) -> UserError:
    """The Hugging Face cache lacks ``repo`` (or holds it ``how``: "without its weights") and
    nothing may, or can, download it."""
    held = f"holds it {how}" if how else "does not hold it (or only in part)"
    at = f" at revision {repo.revision!r}" if repo.revision else ""
    if offline():
        return UserError(
            repo.where,
            f"{repo.repo_id} is not a {repo.local}, and the Hugging Face cache {_cache()} {held}"
            f"{at}, which HF_HUB_OFFLINE=1 keeps from being downloaded",
            "fetch it once where the Hub can be reached (HF_HUB_OFFLINE unset), or set HF_HOME to "
            "a cache that holds it",
        )
    cause = (err.__cause__ or err.__context__ or err) if err is not None else None
    reason = f" ({type(cause).__name__}: {first_line(cause)})" if cause is not None else ""
    return UserError(
        repo.where,
        f"{repo.repo_id} is not a {repo.local}, the Hugging Face cache {_cache()} {held}{at}, "
        f"and the Hugging Face Hub cannot be reached{reason}",
        "connect this machine to the Hub (or set HF_ENDPOINT to a mirror), or fetch it elsewhere "
        "into a cache and set HF_HOME to that",
    )


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


@contextlib.contextmanager
def progress_bars() -> Iterator[None]:
    """huggingface_hub's progress bars where stderr is a terminal, none in a log (where
    HF_HUB_DISABLE_PROGRESS_BARS is set, it decides)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    if (
        sys.stderr.isatty()
        or constants.HF_HUB_DISABLE_PROGRESS_BARS is not None
        or are_progress_bars_disabled()
    ):
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


# ------------------------------------------------------------------------------------ once a node


def once_per_node(repo: HubRepo, what: str, fetch: Callable[[], Path]) -> Path:
    """``fetch()``'s folder, fetched by the node's local rank 0 while its other ranks wait for it
    (the module docstring says how). ``what`` tells apart two fetches of one repository (a model
    with and without its weights, two configurations of a dataset)."""
    if launcher.local_ranks() <= 1:
        return fetch()
    marker = _marker(repo, what)
    if launcher.local_rank() == 0:
        return _fetch_and_tell(marker, fetch)
    return _wait_for_rank_0(marker, fetch)


def _marker(repo: HubRepo, what: str) -> Path:
    from huggingface_hub import constants

    key = json.dumps([repo.kind, repo.repo_id, repo.revision, what])
    name = f"{repo.kind}s--{repo.repo_id.replace('/', '--')}--"
    # beside huggingface_hub's own locks: a scan of the cache (hf cache scan) skips that folder
    return (
        Path(constants.HF_HUB_CACHE)
        / ".locks"
        / "grpo_ds"
        / f"{name}{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    )


def _fetch_and_tell(marker: Path, fetch: Callable[[], Path]) -> Path:
    """Local rank 0: fetch under the lock, then write the marker (the folder, or the refusal)."""
    with _locked(marker, wait=True) as held:
        try:
            folder = fetch()
        except UserError as err:
            if held:
                _tell(marker, {"error": [err.where, err.what, err.fix]})
            raise
        if held:
            _tell(marker, {"folder": str(folder)})
        return folder


def _wait_for_rank_0(marker: Path, fetch: Callable[[], Path]) -> Path:
    """The node's other ranks: the folder (or the refusal) the marker tells, once one written in
    this launch is there."""
    started = _launch_started()
    if started is None or not _writable(marker.parent):
        return fetch()  # no marker can tell: every rank fetches (the cache's own locks hold)
    alone_at = time.monotonic() + ALONE_AFTER_S
    while (folder := _read(marker, started)) is None:
        if time.monotonic() > alone_at:
            with _locked(marker, wait=False) as held:
                if held:  # no rank fetches: do it here
                    return _read(marker, started) or fetch()
        time.sleep(POLL_S)
    return folder


@contextlib.contextmanager
def _locked(marker: Path, wait: bool) -> Iterator[bool]:
    """Inside: whether this process holds the marker's lock file (False where the cache cannot be
    written in, or, not ``wait``-ing, where another process holds it)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        lock = open(marker.with_suffix(".lock"), "a")  # closed below, which releases the lock
    except OSError:
        yield False
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _tell(marker: Path, told: dict) -> None:
    try:
        write_atomic(marker, json.dumps({**told, "written": time.time()}))
    except OSError:  # the waiting ranks then fetch for themselves (ALONE_AFTER_S)
        pass


def _read(marker: Path, started: float) -> Path | None:
    """The folder a marker written since ``started`` tells (its refusal raised), else None."""
    try:
        told = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(told, dict) or not isinstance(told.get("written"), (int, float)):
        return None
    if told["written"] < started:  # an earlier launch's
        return None
    if "error" in told:
        raise UserError(*told["error"])
    return Path(told["folder"])


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _launch_started() -> float | None:
    """When this rank's launcher, its parent process, started (seconds since the epoch); None where
    /proc cannot tell. /proc/PID/stat's 22nd field is the start in clock ticks after boot."""
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
