"""One owner per run folder (grpo_ds.run.lock): a live holder refuses a second launch, naming it; a
dead holder's lock is taken over (this host: the process is gone or its pid was reused; another
host: no heartbeat for STALE_S)."""

import json
import os
import subprocess
import sys
import time

import pytest

from grpo_ds.config.loading import load_recipe
from grpo_ds.errors import UserError
from grpo_ds.run import folder as run_folder
from grpo_ds.run import lock as run_lock
from grpo_ds.run.lock import LOCK, Holder, RunLock, read_holder
from tests.launch import REPO, clean_env, free_port, launch_command, remove_shm_buffers


def test_the_holder_is_written_and_removed_on_release(tmp_path):
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    holder = read_holder(tmp_path / "run" / LOCK)
    assert holder == lock.holder and holder.pid == os.getpid() and holder.process_start
    lock.release()
    assert not (tmp_path / "run" / LOCK).exists()
    lock.release()  # idempotent


def test_a_live_holder_refuses_a_second_launch_by_name(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    (tmp_path / "metrics.jsonl").write_text("x\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(UserError) as err:
        RunLock(tmp_path).acquire()
    text = str(err.value)
    assert text.startswith(
        f"run.name: the run folder {tmp_path} is in use by another launch (host "
    )
    assert f"pid {os.getpid()}" in text and first.holder.started in text and "\n" not in text
    # the refused launch touched nothing
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    first.release()


def _write(path, holder: Holder):
    path.write_text(json.dumps(vars(holder)) + "\n")


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    me = Holder.me()
    _write(tmp_path / LOCK, Holder(me.host, int(gone.stdout), "123", "2026-01-01 00:00:00 UTC"))
    lock = RunLock(tmp_path)
    lock.acquire()  # SIGKILL, a crash: the next launch goes on
    assert read_holder(tmp_path / LOCK) == lock.holder and not list(
        tmp_path.glob(f"{LOCK}.stale-*")
    )
    lock.release()


def test_a_reused_pid_does_not_keep_a_dead_lock(tmp_path):
    me = Holder.me()
    # this pid, another process start
    _write(tmp_path / LOCK, Holder(me.host, os.getpid(), "1", me.started))
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_another_hosts_lock_holds_while_its_heartbeat_is_fresh(tmp_path):
    _write(tmp_path / LOCK, Holder("node-7", 4242, "99", "2026-01-01 00:00:00 UTC"))
    with pytest.raises(UserError, match="host node-7, pid 4242"):
        RunLock(tmp_path).acquire()
    old = time.time() - run_lock.STALE_S - 5
    os.utime(tmp_path / LOCK, (old, old))  # a lost node: no heartbeat since
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_the_heartbeat_keeps_a_long_step_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK, (old, old))

    def age() -> float:
        return time.time() - (tmp_path / LOCK).stat().st_mtime

    # 0.05 s beats; a busy machine may hold the thread back a while
    deadline = time.monotonic() + 10
    while age() > 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert age() < 100  # touched again by the holder (it was 1,000 s old)
    lock.release()


def test_a_torn_lock_file_from_a_crash_is_taken_over(tmp_path):
    (tmp_path / LOCK).write_text('{"host": ')  # a launch died while writing it
    old = time.time() - 60
    os.utime(tmp_path / LOCK, (old, old))
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_overwriting_a_run_keeps_the_lock_of_the_launch_that_overwrites(tmp_path):
    recipe = load_recipe({"run": {"output_dir": str(tmp_path), "name": "r", "overwrite": True}})
    path = run_folder.folder_path(recipe)
    lock = RunLock(path)
    lock.acquire()
    (path / "metrics.jsonl").write_text("{}\n")
    (path / "checkpoints").mkdir()
    run_folder.prepare(run_folder.decide(recipe), recipe, {})
    assert sorted(p.name for p in path.iterdir()) == ["deepspeed.json", "recipe.json", LOCK]
    lock.release()


def _launcher(tmp_path, port, *extra):
    return launch_command(
        2,
        [
            "--module",
            "grpo_ds.train",
            REPO / "recipes" / "tiny_cpu.json",
            f"run.output_dir={tmp_path}",
            "logging.progress_bar=false",
            *extra,
        ],
        port,
    )


GATED_REWARD = """
import time
from pathlib import Path


def exact_match_once_released(*, completions, answer, **kwargs):
    while Path(__file__).with_name("hold").exists():  # the first launch holds its lock, mid-step, until released
        time.sleep(0.05)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""  # noqa: E501


@pytest.mark.slow
def test_a_second_launch_is_refused_and_the_first_run_ends_intact(tmp_path):
    """Two launches of the same command: the second (one process) stops with one line naming the
    first (two ranks through the launcher) and exit 2, and the first finishes with exactly its
    steps. The first run's reward waits while a file exists, so it is mid-run (step 1, lock held)
    for as long as the second launch takes."""
    (tmp_path / "gated_reward.py").write_text(GATED_REWARD)
    (tmp_path / "hold").touch()
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    gated = [
        'reward.functions=[{"name": "gated_reward:exact_match_once_released"}]',
        "reward.timeout_s=600",
        "train.steps=3",
    ]
    port = free_port()
    first = subprocess.Popen(
        _launcher(tmp_path, port, *gated),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lock = tmp_path / "tiny_cpu" / LOCK
        deadline = time.monotonic() + 300
        while read_holder(lock) is None:
            assert first.poll() is None and time.monotonic() < deadline, (
                "the first launch ended before its lock"
            )
            time.sleep(0.1)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpo_ds.train",
                str(REPO / "recipes" / "tiny_cpu.json"),
                f"run.output_dir={tmp_path}",
                *gated,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        holder = read_holder(lock)
        # still mid-run: the refusal came from its lock, not from a finished folder
        assert first.poll() is None
        (tmp_path / "hold").unlink()
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert (
            errors == [line for line in second.stderr.splitlines() if "error" in line.lower()]
            and len(errors) == 1
        )
        assert f"host {holder.host}, pid {holder.pid}, started {holder.started}" in errors[0]
        out, _ = first.communicate(timeout=600)
    finally:
        (tmp_path / "hold").unlink(missing_ok=True)
        first.kill()
        remove_shm_buffers(port)
    assert first.returncode == 0, out[-3000:]
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]
    assert not lock.exists()  # released at the end


@pytest.mark.slow
def test_a_killed_runs_lock_does_not_block_the_next_launch(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "grpo_ds.train",
        str(REPO / "recipes" / "tiny_cpu.json"),
        f"run.output_dir={tmp_path}",
        "train.steps=10",
        "checkpoint.every_steps=5",
        "logging.progress_bar=false",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    log = tmp_path / "tiny_cpu" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and len(log.read_text().splitlines()) >= 6):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.kill()  # SIGKILL: the lock stays behind, naming a process that is gone
    proc.wait()
    assert read_holder(tmp_path / "tiny_cpu" / LOCK).pid == proc.pid
    again = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after step" in again.stderr
