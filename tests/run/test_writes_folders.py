"""grpo_ds.run.writes.folder_written / publish_folder: the one way a folder (a checkpoint, the final
model, an export, a universal checkpoint) is written: under a temporary name, every file and folder
fsynced, then renamed into place."""

import errno
import os

import pytest

from grpo_ds.run import writes


@pytest.fixture
def events(monkeypatch):
    """What reaches the disk, in order: ("fsync", path) and ("rename", src, dst)."""
    seen = []
    real_file, real_dir, real_rename = writes.fsync_file, writes.fsync_dir, os.rename
    monkeypatch.setattr(writes, "fsync_file", lambda p: (seen.append(("fsync", p)), real_file(p)))
    monkeypatch.setattr(writes, "fsync_dir", lambda p: (seen.append(("fsync", p)), real_dir(p)))
    monkeypatch.setattr(
        os, "rename", lambda s, d: (seen.append(("rename", s, d)), real_rename(s, d))
    )
    return seen


def _write(folder, files):
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def _read(folder):
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def test_a_folder_is_fsynced_whole_before_it_is_renamed_into_place(tmp_path, events):
    final = tmp_path / "model"
    with writes.folder_written(final) as tmp:
        assert (
            tmp.parent == tmp_path
            and tmp.name.startswith(writes.TMP_PREFIX)
            and not any(tmp.iterdir())
        )
        _write(tmp, {"config.json": "{}", "shards/a.bin": "a", "shards/b.bin": "b"})
    assert _read(final) == {"config.json": "{}", "shards/a.bin": "a", "shards/b.bin": "b"}
    assert os.listdir(tmp_path) == ["model"]  # no temporary folder left
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert [events[i][1:] for i in renames] == [(tmp, final)]
    before = {e[1] for e in events[: renames[0]]}
    assert before == {
        tmp / "config.json",
        tmp / "shards/a.bin",
        tmp / "shards/b.bin",
        tmp / "shards",
        tmp,
    }
    assert events[renames[0] + 1 :] == [("fsync", tmp_path)]  # the rename itself reaches the disk


def test_an_existing_folder_is_replaced_only_by_a_complete_one(tmp_path, events):
    final = tmp_path / "model"
    _write(final, {"old.bin": "old"})
    with (
        pytest.raises(RuntimeError, match="the writer failed"),
        writes.folder_written(final) as tmp,
    ):
        _write(tmp, {"new.bin": "half"})
        raise RuntimeError("the writer failed")
    assert _read(final) == {"old.bin": "old"} and os.listdir(tmp_path) == ["model"]
    assert not [e for e in events if e[0] == "rename"]

    with writes.folder_written(final) as tmp:
        _write(tmp, {"new.bin": "new"})
    assert _read(final) == {"new.bin": "new"} and os.listdir(tmp_path) == ["model"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    final = tmp_path / "model"
    _write(final, {"old.bin": "old"})
    real_rename = os.rename

    def rename(src, dst):
        if str(src).endswith(f"model-{os.getpid()}"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError) as raised, writes.folder_written(final) as tmp:
        _write(tmp, {"new.bin": "new"})
    assert raised.value.errno == errno.EROFS and raised.value.filename == str(tmp)
    assert _read(final) == {"old.bin": "old"} and os.listdir(tmp_path) == ["model"]
