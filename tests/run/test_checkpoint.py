"""The one listing of a run's checkpoints (grpo_ds.run.checkpoint.step_folders) and what resume and
export build on it."""

from pathlib import Path

from grpo_ds.run.checkpoint import StepFolder, complete_checkpoints, latest_name, step_folders


def _run(tmp_path: Path, names: list[str], latest: str | None = None) -> Path:
    root = tmp_path / "checkpoints"
    for name in names:
        (root / name).mkdir(parents=True)
    (root / "step_00000007.txt").write_text("a file, not a folder")
    if latest is not None:
        (root / "latest").write_text(latest + "\n")
    return tmp_path


def test_step_folders_lists_step_folders_oldest_first_and_nothing_else(tmp_path):
    run = _run(
        tmp_path,
        ["step_00000020", "step_00000005", ".tmp-step_00000030", "step_old", "step_00000010"],
    )
    root = run / "checkpoints"
    assert step_folders(run) == [
        StepFolder(5, root / "step_00000005"),
        StepFolder(10, root / "step_00000010"),
        StepFolder(20, root / "step_00000020"),
    ]
    assert step_folders(tmp_path / "elsewhere") == []


def test_complete_checkpoints_newest_first_with_the_latest_pointer_first(tmp_path):
    run = _run(
        tmp_path, ["step_00000005", "step_00000010", "step_00000020"], latest="step_00000010"
    )
    assert latest_name(run) == "step_00000010"
    assert [p.name for p in complete_checkpoints(run)] == [
        "step_00000010",
        "step_00000020",
        "step_00000005",
    ]
    (run / "checkpoints" / "latest").unlink()
    assert latest_name(run) is None
    assert [p.name for p in complete_checkpoints(run)] == [
        "step_00000020",
        "step_00000010",
        "step_00000005",
    ]
