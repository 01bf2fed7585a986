"""Writes that fail cleanly: a full disk, a read-only file system, an exceeded quota.

A failed write (of a checkpoint, a run file or an export) becomes one ``UserError`` line naming the
file, the cause as the operating system names it ("No space left on device (ENOSPC)") and what to
do, instead of a traceback. Some writers hide the operating system's error: torch's zip writer
reports a full disk as ``RuntimeError: ... unexpected pos``, safetensors as its own error. Such an
error is a write failure when a small probe write beside the file fails now, and the probe's error
is the cause; when the probe succeeds the original error is not a disk problem and is raised as it
was.

``write_atomic`` replaces a small file (a run file, the ``latest`` pointer) so that a crash leaves
the old or the new content, never a mix: write a temporary file beside it, fsync it, rename it over
the target, fsync the folder.

``folder_written`` and ``publish_folder`` do the same for a folder (a checkpoint, the final model,
an export, a universal checkpoint): it is written under a temporary name beside its final one, its
files and folders are fsynced, and it is renamed into place, so that a crash leaves no partial
folder under the final name.

``check_space`` refuses, before anything is written, a write whose expected size exceeds the free
space. ``agree`` makes every rank raise the same error when a write failed on any of them, so that
no rank is left waiting in a collective for one that stopped.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_ds.distributed.ranks import Dist
from grpo_ds.errors import UserError

# a folder being written; never a finished one (a crash may leave it: its writer removes it)
TMP_PREFIX = ".tmp-"
# Free space asked beyond a write's expected size: a checkpoint's trainer state grows with the
# metric history, and file systems round files up to whole blocks.
SPACE_MARGIN = 0.05
PROBE_BYTES = 1 << 20  # the probe write that finds the cause a writer hid: 1 MiB, removed at once
# What to do about each cause (the start of a fix); any other cause: "fix the file system".
_REMEDIES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EROFS: "make the file system writable",
    errno.EACCES: "make the folder writable",
    errno.EPERM: "make the folder writable",
    errno.EFBIG: "allow larger files on the file system",
    errno.ENAMETOOLONG: "use shorter names",
}


def describe(err: OSError) -> str:
    """The cause of a failed write as the operating system names it: "No space left on device
    (ENOSPC)"."""
    if err.errno is None:
        return err.strerror or str(err)
    return f"{os.strerror(err.errno)} ({errno.errorcode.get(err.errno, err.errno)})"


def remedy(err: OSError) -> str:
    """What a user does about ``err``: "free space", "make the file system writable", ..."""
    return _REMEDIES.get(err.errno, "fix the file system")


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Writes to ``path`` inside: an OSError that names no file (a failed ``write()`` or
    ``close()``) is raised naming ``path``; another error is raised as the OSError a probe write
    beside ``path`` gets now (the cause a writer hid), or unchanged when the probe succeeds."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except Exception as err:
        found = probe(Path(path).parent)
        if found is None:
            raise
        raise OSError(found.errno, found.strerror, str(path)) from err


def probe(folder: Path) -> OSError | None:
    """The OSError a write of PROBE_BYTES into ``folder`` (or its nearest existing parent) raises,
    None if it succeeds; the probe file is removed either way."""
    folder = Path(folder)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    path = folder / f".grpo_ds-write-probe-{os.getpid()}"
    try:
        with path.open("wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as err:
        return err
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk (a failed flush is an OSError naming it)."""
    with writing(path), path.open("rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename or a new file in it) to the disk."""
    with writing(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: the old content or the new one survives a crash at any
    moment, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(tmp):
        tmp.write_text(text)
    fsync_file(tmp)
    with writing(path):
        os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, then every folder (the deepest first, ``folder`` last), to
    the disk."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fsync_file(path)
    for path in sorted(
        {p.parent for p in folder.rglob("*")} | {folder}, key=lambda p: -len(p.parts)
    ):
        fsync_dir(path)


def publish_folder(tmp: Path, final: Path) -> None:
    """Put the complete folder ``tmp`` (beside ``final``: a rename stays on one file system) in
    place as ``final``: fsync its files and folders, rename it, fsync the parent. An existing
    ``final`` is renamed aside first and removed once the new one is in place (a folder cannot be
    renamed over a full one); if the rename fails it is put back. A crash at any moment leaves
    ``tmp`` unfinished, or the old or the new ``final`` whole (the old one under a ``.tmp-`` name
    only between the two renames). An OSError names the path that failed."""
    fsync_tree(tmp)
    aside = final.with_name(f"{TMP_PREFIX}old-{final.name}")
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except OSError:
        if aside.exists():
            os.rename(aside, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def folder_written(final: Path) -> Iterator[Path]:
    """An empty temporary folder beside ``final`` to write in; when the block ends it replaces
    ``final`` (``publish_folder``). On any error, in the block or in publishing, the temporary
    folder is removed and ``final`` is left as it was."""
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(tmp):
            tmp.mkdir(parents=True)
        yield tmp
        publish_folder(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def append_line(path: Path, line: str) -> None:
    """Append one line (a JSON record) to a log; a failed write is an OSError naming ``path``."""
    with writing(path), path.open("a") as f:
        f.write(line + "\n")


def free_bytes(folder: Path) -> int:
    """Free space, in bytes, of the file system holding ``folder`` (or its nearest existing
    parent)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_space(where: str, folder: Path, needed: int, what: str, fix: str) -> None:
    """Refuse (UserError) a write of about ``needed`` bytes into ``folder`` when less is free;
    ``what`` says what is written and how its size is known, ``fix`` what to do."""
    free = free_bytes(folder)
    if needed > free:
        raise UserError(
            where,
            f"not enough free space in {folder} for {what}: it needs about {gib(needed)}, "
            f"{gib(free)} is free",
            fix,
        )


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def agree(dist: Dist, failure: Exception | None) -> None:
    """Collective: when any rank passes a failure, every rank raises the lowest such rank's (a
    UserError is one line on rank 0's console); otherwise nothing happens. One all-reduce of a flag
    when nothing failed (an all-gather of objects every step made 2-rank CPU runs abort at exit now
    and then, in gloo's teardown)."""
    if dist.world_size == 1:
        if failure is not None:
            raise failure
        return
    flag = torch.tensor([0 if failure is None else dist.world_size - dist.rank], dtype=torch.int64)
    dist.all_reduce_max(flag)
    if flag.item() == 0:
        return
    box = [failure]
    # the lowest failing rank
    torch.distributed.broadcast_object_list(box, src=dist.world_size - int(flag.item()))
    raise box[0]
