"""Every folder a run writes in is made and probed before any model loads
(grpo_ds/run/output_paths.py).

Through real runs (`python -m grpo_ds.train` and `python -m grpo_ds.check`), each way a place cannot
be created or written in gives one line `error: <key>: <path> ...`, exit code 2, no traceback, and
nothing written. The plain cases run as forks of one preloaded process (tests/scripts/cli_forks.py);
a read-only and a full file system need a mount of their own, so those run as fresh processes in a
private mount namespace (`unshare -m`, root), and are skipped where that is not allowed. A full file
system is the case only the probe's write can see (the dry run's inspection passes it): the run
stops there after DeepSpeed's process group exists, before the lock and any model, on every rank.
"""

import errno
import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.launcher import free_port
from grpo_ds.distributed.ranks import Dist
from grpo_ds.errors import UserError
from grpo_ds.run import output_paths, writes
from grpo_ds.step.profiling import PROFILE_DIR
from tests.launch import REPO, clean_env, launch_command, remove_shm_buffers
from tests.scripts.cli_forks import run_forked

TINY = str(REPO / "recipes" / "tiny_cpu.json")
FILE_FIX = "give a folder path, or move the file away."

# name -> (overrides, files written into the working directory first, the expected line); {dir}: the
# working directory
CASES = {
    "a_file_on_the_way": (
        ["run.output_dir={dir}/afile/runs"],
        {"afile": "not a folder"},
        "error: run.output_dir: {dir}/afile/runs cannot be created: {dir}/afile is a file. "
        + FILE_FIX,
    ),
    "a_special_file_system": (
        ["run.output_dir=/proc/grpo_ds_probe_test/runs"],
        {},
        "error: run.output_dir: /proc/grpo_ds_probe_test/runs cannot be created: /proc is a proc "
        "file system that the kernel fills. give a folder on a disk.",
    ),
    "a_name_too_long": (
        ["run.output_dir={dir}/out", "run.name=" + "n" * 300],
        {},
        "error: run.name: {dir}/out/" + "n" * 300 + " cannot be created: File name too long "
        "(ENAMETOOLONG). use shorter names, or give another folder.",
    ),
    # the run folder is fine; the profile folder inside it (logging.profile_steps) is a file
    "a_blocked_subfolder": (
        ["run.output_dir={dir}/out", "logging.profile_steps=[1,1]"],
        {"out/tiny_cpu/profile": "not a folder"},
        "error: logging.profile_steps: {dir}/out/tiny_cpu/profile exists and is not a folder. "
        + FILE_FIX,
    ),
}


def _tree(root: Path) -> set:
    return {(str(p.relative_to(root)), p.is_dir()) for p in root.rglob("*")}


def _one_error_line(code: int, stdout: str, stderr: str) -> str:
    """The run's one error line, after checking the exit code and that there is no traceback."""
    assert code == 2, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> dict:
    """Each case once through grpo_ds.train and once through grpo_ds.check, each in its own working
    directory: (result, working directory, its tree before)."""
    base = tmp_path_factory.mktemp("output_paths")
    commands, prepared = [], []
    for name, (overrides, files, _) in CASES.items():
        for module in ("grpo_ds.train", "grpo_ds.check"):
            workdir = base / f"{name}-{module}"
            workdir.mkdir()
            for rel, text in files.items():
                (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
                (workdir / rel).write_text(text)
            commands.append(
                ([module, TINY, *(o.replace("{dir}", str(workdir)) for o in overrides)], workdir)
            )
            prepared.append((name, module, workdir, _tree(workdir)))
    finished = run_forked(commands, dict(os.environ), base / "_forks", parallel=1)
    return {
        (name, module): (result, workdir, before)
        for (name, module, workdir, before), result in zip(prepared, finished, strict=True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("module", ["grpo_ds.train", "grpo_ds.check"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_place_that_cannot_be_written_is_one_line_and_nothing_is_written(forked, name, module):
    result, workdir, before = forked[(name, module)]
    line = _one_error_line(result.returncode, result.stdout, result.stderr)
    # the dry run's line is the run's, word for word
    assert line == CASES[name][2].replace("{dir}", str(workdir))
    assert _tree(workdir) == before  # no run folder, no lock, no recipe.json, no logs
    assert not Path("/proc/grpo_ds_probe_test").exists()


# ----------------------------------------------------------- file systems of their own (unshare -m)


@functools.cache
def _can_mount() -> bool:
    """Whether this process may make a private mount namespace and mount a tmpfs in it (root with
    CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        return False
    probe = Path(f"/tmp/grpo_ds-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
            capture_output=True,
            timeout=30,
        )
        return done.returncode == 0
    finally:
        probe.rmdir()


needs_mount = pytest.mark.skipif(
    not _can_mount(), reason="needs `unshare -m` and mount (root, CAP_SYS_ADMIN)"
)


def _on_own_tmpfs(
    mount: Path, options: str, command: list[str], listing: Path
) -> subprocess.CompletedProcess:
    """``command`` in a private mount namespace where ``mount`` is a fresh tmpfs with ``options``;
    what the tmpfs holds afterwards is written to ``listing`` (one name a line)."""
    mount.mkdir()
    script = (
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(mount))} || exit 99\n"
        f"{shlex.join(command)}\ncode=$?\n"
        f"ls -A {shlex.quote(str(mount))} > {shlex.quote(str(listing))}\n"
        "exit $code\n"
    )
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 99, done.stderr
    return done


@pytest.mark.slow
@needs_mount
@pytest.mark.parametrize("module", ["grpo_ds.train", "grpo_ds.check"])
def test_a_read_only_file_system(tmp_path, module):
    mount, listing = tmp_path / "ro", tmp_path / "listing"
    done = _on_own_tmpfs(
        mount,
        "ro,size=64k",
        [sys.executable, "-m", module, TINY, f"run.output_dir={mount}/runs"],
        listing,
    )
    line = _one_error_line(done.returncode, done.stdout, done.stderr)
    assert line == (
        f"error: run.output_dir: {mount}/runs cannot be created: Read-only file system (EROFS). "
        "make the file system writable, or give another folder."
    )
    assert listing.read_text() == ""


@pytest.mark.slow
@needs_mount
def test_a_full_file_system_is_found_by_the_probe_write_before_the_lock(tmp_path):
    """64 KiB free: every folder can be made, but the probe's write cannot land. Only the run's
    probe sees it (the dry run inspects without writing, and passes); the run stops before the lock,
    and leaves the tmpfs empty."""
    mount, listing = tmp_path / "full", tmp_path / "listing"
    done = _on_own_tmpfs(
        mount,
        "size=64k",
        [sys.executable, "-m", "grpo_ds.train", TINY, f"run.output_dir={mount}/runs"],
        listing,
    )
    line = _one_error_line(done.returncode, done.stdout, done.stderr)
    assert line == (
        f"error: run.output_dir: {mount}/runs cannot be written in: No space left on device "
        "(ENOSPC). free space, or give another folder."
    )
    assert listing.read_text() == ""  # not even runs/: made for the probe, then removed
    checked = _on_own_tmpfs(
        tmp_path / "full-check",
        "size=64k",
        [sys.executable, "-m", "grpo_ds.check", TINY, f"run.output_dir={tmp_path}/full-check/runs"],
        tmp_path / "listing-check",
    )
    assert checked.returncode == 0, checked.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_stop_with_one_line(tmp_path):
    """Through the deepspeed launcher, 2 ranks: rank 0 probes, and both ranks stop with its line
    (exit 2). With a mount of its own the place is a full file system, which only rank 0's probe
    finds (the other rank learns it through Dist.decide); without one, a file on the way, which
    every rank's inspection finds."""
    port = free_port()
    command = launch_command(2, ["--module", "grpo_ds.train", TINY], port)
    try:
        if _can_mount():
            mount = tmp_path / "full"
            done = _on_own_tmpfs(
                mount, "size=64k", [*command, f"run.output_dir={mount}/runs"], tmp_path / "listing"
            )
            expected = (
                f"error: run.output_dir: {mount}/runs cannot be written in: No space left on "
                "device (ENOSPC). free space, or give another folder."
            )
            assert (tmp_path / "listing").read_text() == ""
        else:
            (tmp_path / "afile").write_text("not a folder")
            done = subprocess.run(
                [*command, f"run.output_dir={tmp_path}/afile/runs"],
                cwd=tmp_path,
                env=clean_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            expected = (
                f"error: run.output_dir: {tmp_path}/afile/runs "
                f"cannot be created: {tmp_path}/afile is a file. "
            )
            expected += FILE_FIX
    finally:
        remove_shm_buffers(port)
    assert _one_error_line(done.returncode, done.stdout, done.stderr) == expected


# ----------------------------------------------------------------------------------- in one process


def _recipe(tmp_path: Path, *overrides: str):
    return load_recipe(TINY, [f"run.output_dir={tmp_path / 'out'}", *overrides])


def test_places_follow_the_keys_that_turn_them_on(tmp_path):
    run_dir = tmp_path / "out" / "tiny_cpu"
    plain = {
        (p.key, p.path)
        for p in output_paths.places(_recipe(tmp_path, "run.save_final_model=false"))
    }
    assert plain == {
        ("run.output_dir", tmp_path / "out"),
        ("run.name", run_dir),
        ("run.name", run_dir / "ranks"),
        ("checkpoint.every_steps", run_dir / "checkpoints"),
    }
    every = output_paths.places(
        _recipe(
            tmp_path,
            "logging.tensorboard=true",
            "logging.wandb_project=p",
            "logging.profile_steps=[1,1]",
        )
    )
    assert {p.key: p.path.name for p in every[4:]} == {
        "run.save_final_model": "final_model",
        "logging.tensorboard": "tensorboard",
        "logging.wandb_project": "wandb",
        "logging.profile_steps": PROFILE_DIR,
    }
    off = _recipe(tmp_path, "logging.wandb_project=p", "logging.wandb_mode=disabled")
    assert "logging.wandb_project" not in {p.key for p in output_paths.places(off)}


def test_a_probe_that_succeeds_leaves_the_file_system_as_it_was(tmp_path):
    recipe = _recipe(tmp_path, "logging.tensorboard=true", "logging.profile_steps=[1,1]")
    output_paths.probe(recipe)
    # an empty checkpoints/ left behind would read as a run to resume
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "out" / "tiny_cpu" / "checkpoints").mkdir(parents=True)
    before = _tree(tmp_path)
    output_paths.probe(recipe)
    assert _tree(tmp_path) == before


def test_a_probe_that_fails_removes_every_folder_it_made_deepest_first(tmp_path, monkeypatch):
    """The profile folder's write fails (a quota, say) after the probe made out/, the run folder and
    four folders in it: the error names logging.profile_steps, and every one of them is gone, each
    after the folders inside it."""
    real_probe, removed, real_rmdir = writes.probe, [], os.rmdir

    def probe(folder):
        if folder.name == PROFILE_DIR:
            return OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return real_probe(folder)

    monkeypatch.setattr(writes, "probe", probe)
    monkeypatch.setattr(
        output_paths.os, "rmdir", lambda p: (removed.append(Path(p)), real_rmdir(p))
    )
    with pytest.raises(UserError) as caught:
        output_paths.probe(_recipe(tmp_path, "logging.profile_steps=[1,1]"))
    profile = tmp_path / "out" / "tiny_cpu" / PROFILE_DIR
    assert str(caught.value) == (
        f"logging.profile_steps: {profile} cannot be written in: Disk quota exceeded "
        "(EDQUOT). free space or raise the disk quota, or give another folder."
    )
    assert list(tmp_path.iterdir()) == []
    # out, the run folder, ranks ... profile
    assert removed[-1] == tmp_path / "out" and len(removed) == 6
    assert all(
        not any(q.is_relative_to(p) for q in removed[i + 1 :]) for i, p in enumerate(removed)
    )


class _Store:
    """The split launch's TCP store, as far as the probe uses it."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key]


def test_split_placement_the_rollout_ranks_stop_with_the_trainers_line(tmp_path):
    """The trainer's rank 0 probes and leaves its outcome in the launch's store; a rollout rank (a
    world of its own) raises the same error from there."""
    (tmp_path / "afile").write_text("x")
    recipe = load_recipe(TINY, [f"run.output_dir={tmp_path / 'afile' / 'runs'}"])
    store = _Store()
    trainer = Dist(
        rank=0, world_size=1, local_rank=0, device="cpu", role="trainer", launch_rank=0, store=store
    )
    rollout = Dist(
        rank=0, world_size=1, local_rank=1, device="cpu", role="rollout", launch_rank=1, store=store
    )
    with pytest.raises(UserError) as on_trainer:
        output_paths.probe_on_rank_0(recipe, trainer)
    with pytest.raises(UserError) as on_rollout:
        output_paths.probe_on_rank_0(recipe, rollout)
    assert (
        str(on_rollout.value) == str(on_trainer.value)
        and on_trainer.value.where == "run.output_dir"
    )
    fine = load_recipe(TINY, [f"run.output_dir={tmp_path / 'ok'}"])
    output_paths.probe_on_rank_0(fine, trainer)
    output_paths.probe_on_rank_0(fine, rollout)  # the trainer's "nothing failed" reaches it too
    assert not (tmp_path / "ok").exists()


def test_a_path_too_long_as_a_whole_is_seen_by_looking(tmp_path):
    """Every name fits (200 bytes) but the path passes PATH_MAX: the dry run says so, in the probe's
    words."""
    deep = "/".join(["d" * 200] * 25)
    recipe = load_recipe(TINY, [f"run.output_dir={tmp_path / deep}"])
    with pytest.raises(UserError) as looked:
        output_paths.inspect(recipe)
    with pytest.raises(UserError) as probed:
        output_paths.probe(recipe)
    assert str(looked.value) == str(probed.value)
    assert str(looked.value).endswith(
        "cannot be created: File name too long (ENAMETOOLONG). use shorter names, or "
        "give another folder."
    )
    assert list(tmp_path.iterdir()) == []
