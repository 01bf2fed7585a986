"""Graceful preemption (grpo_ds/run/preemption.py): SIGTERM or SIGUSR1 stops a run at the next step boundary with a
checkpoint and exit code 75, within the launcher's 30 s grace; the same command resumes with the metrics of an
uninterrupted run; a signal during a checkpoint write lets the write finish; a second SIGTERM stops at once."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from grpo_ds.run import checkpoint
from grpo_ds.run.preemption import EXIT_PREEMPTED
from tests.launch import REPO, clean_env, rank_log_records
from tests.test_resume import PORTS, _logged_steps, _metrics, reference_run
from tests.test_resume import _remove_shm_buffers as _remove_shm_buffers  # noqa: F401 - the module's fixture

# reference_run's runs are cached in tests/test_resume.py's module: its users share a worker (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("reference_run")

TINY = str(REPO / "recipes" / "tiny_cpu.json")
STEPS = 12
GRACE_S = 30  # DeepSpeed's launcher: SIGTERM to each rank, SIGKILL 30 s later
ARGS = [f"train.steps={STEPS}", "rollout.prompts_per_step=8", "train.micro_batch_samples_per_gpu=32",
        "train.samples_per_optimizer_step=64", "logging.progress_bar=false"]


def _command(world: int, out: Path, *extra: str) -> list[str]:
    args = [TINY, f"run.output_dir={out}", *ARGS, *extra]
    if world == 1:
        return [sys.executable, "-m", "grpo_ds.train", *args]
    from tests.launch import free_port

    launcher = Path(sys.executable).parent / "deepspeed"
    PORTS.append(free_port())
    return [str(launcher) if launcher.exists() else "deepspeed", "--num_gpus", str(world), "--master_port",
            str(PORTS[-1]), "--module", "grpo_ds.train", *args]


def _wait_for(condition, proc: subprocess.Popen, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert proc.poll() is None, f"the run ended first:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _launch_process(runner: subprocess.Popen) -> psutil.Process:
    """The `deepspeed` command's per-node launcher (deepspeed.launcher.launch), which forwards signals to the ranks."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(runner.pid).children(recursive=True):
            if "deepspeed.launcher.launch" in " ".join(child.cmdline()):
                return child
        time.sleep(0.1)
    raise AssertionError("no deepspeed.launcher.launch process")


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_the_same_command_resumes_exactly(tmp_path,
                                                                                             tmp_path_factory, world):
    extra = ["checkpoint.every_steps=50"]  # the only checkpoint before the end is the one the signal asks for
    # The uninterrupted run: test_resume's of the same recipe (it checkpoints every 2 steps, which changes no step)
    reference_dir = reference_run(tmp_path_factory, world) / "tiny_cpu"
    expected = _metrics(reference_dir)

    run_dir = tmp_path / "preempted" / "tiny_cpu"
    command = _command(world, tmp_path / "preempted", *extra)
    proc = subprocess.Popen(command, cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    target = psutil.Process(proc.pid) if world == 1 else _launch_process(proc)
    _wait_for(lambda: _logged_steps(run_dir) >= 3, proc)
    target.send_signal(signal.SIGTERM)  # one process: the run itself; two ranks: the launcher, as a scheduler would
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - signalled
    assert took < GRACE_S, f"{took:.1f} s"
    # A rank exits 75; DeepSpeed's launcher, once it has been signalled itself, exits 1 whatever its ranks return.
    assert proc.returncode == (EXIT_PREEMPTED if world == 1 else 1), err[-3000:]
    stopped = _logged_steps(run_dir)
    assert f"preempted: stopped by SIGTERM after step {stopped} of {STEPS}" in err, err[-3000:]
    assert 3 <= stopped < STEPS
    assert checkpoint.latest_name(run_dir) == checkpoint.checkpoint_name(stopped)
    assert checkpoint.verify(run_dir / checkpoint.CHECKPOINTS / checkpoint.checkpoint_name(stopped)) is None

    resumed = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming after step {stopped}" in resumed.stderr
    assert _metrics(run_dir) == expected
    for rank in range(world):  # the same samples trained at every step and the same final weights
        logs = [rank_log_records(folder / "ranks" / f"rank{rank}.jsonl") for folder in (run_dir, reference_dir)]
        assert logs[0] == logs[1]


@pytest.mark.slow
def test_a_sigterm_during_a_checkpoint_write_lets_the_write_finish_and_stops_there(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    proc = subprocess.Popen(_command(1, tmp_path, "checkpoint.every_steps=4"), cwd=REPO, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    root = run_dir / checkpoint.CHECKPOINTS
    writing = []

    def being_written() -> bool:
        writing.extend(p.name for p in (root.iterdir() if root.exists() else ()) if p.name.startswith(".tmp-"))
        return bool(writing)
    _wait_for(being_written, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    name = writing[0].removeprefix(checkpoint.TMP_PREFIX)
    assert checkpoint.latest_name(run_dir) == name  # the checkpoint being written when the signal came, completed
    assert checkpoint.verify(root / name) is None
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert _logged_steps(run_dir) == int(name.removeprefix("step_"))  # and no step after it


def _signal_script(body: str, window_s: float | None = None) -> subprocess.CompletedProcess:
    """Run ``body`` inside stop_on_signals() in a fresh process; ``stop`` is the StopRequest."""
    window = "" if window_s is None else f"preemption.REPEAT_WINDOW_S = {window_s}\n"
    code = (f"import os, signal, time\nfrom grpo_ds.run import preemption\n{window}"
            "with preemption.stop_on_signals() as stop:\n" + textwrap.indent(textwrap.dedent(body), "    ")
            + "\nprint('after', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_the_first_signal_is_a_request_and_a_second_sigterm_stops_at_once():
    done = _signal_script("""
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        print("requested", stop.signal_name, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived", flush=True)""", window_s=0.0)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "requested SIGTERM" in done.stdout and "survived" not in done.stdout
    assert "stopping after this step with a checkpoint" in done.stderr


def test_sigterms_within_the_repeat_window_are_one_request_and_sigusr1_never_kills():
    done = _signal_script("""
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1):  # the launcher's echo too
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
        print("requested", stop.signal_name, flush=True)""")
    assert done.returncode == 0, done.stderr
    assert "requested SIGUSR1" in done.stdout  # the first signal names the request
    assert "after True" in done.stdout  # the handlers that were there before are back
    assert done.stderr.count("received") == 1
