"""Graceful preemption (grpo_ds/run/preemption.py): SIGTERM or SIGUSR1 stops a run at the next step
boundary with a checkpoint and exit code 75, within the launcher's 30 s grace; the same command
resumes with the metrics of an uninterrupted run; a signal during a checkpoint write lets the write
finish; a second SIGTERM stops at once."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from grpo_ds.run import checkpoint
from grpo_ds.run.preemption import ABANDON_LEAD_S, EXIT_PREEMPTED
from tests.launch import (
    REPO,
    clean_env,
    free_port,
    gone,
    launch_command,
    rank_log_records,
    start_stoppable,
    wait_for,
)
from tests.test_resume import PORTS, _logged_steps, _metrics, reference_run
from tests.test_resume import _remove_shm_buffers as _remove_shm_buffers  # noqa: F401 - the module's fixture

# reference_run's runs are cached in tests/test_resume.py's module: its users share a worker
# (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("reference_run")

TINY = str(REPO / "recipes" / "tiny_cpu.json")
STEPS = 12
GRACE_S = 30  # DeepSpeed's launcher: SIGTERM to each rank, SIGKILL 30 s later
ARGS = [
    f"train.steps={STEPS}",
    "rollout.prompts_per_step=8",
    "train.micro_batch_samples_per_gpu=32",
    "train.samples_per_optimizer_step=64",
    "logging.progress_bar=false",
]


def _command(world: int, out: Path, *extra: str) -> list[str]:
    args = [TINY, f"run.output_dir={out}", *ARGS, *extra]
    if world == 1:
        return [sys.executable, "-m", "grpo_ds.train", *args]
    PORTS.append(free_port())
    return launch_command(world, ["--module", "grpo_ds.train", *args], PORTS[-1])


def _launch_process(runner: subprocess.Popen) -> psutil.Process:
    """The `deepspeed` command's per-node launcher (deepspeed.launcher.launch), which forwards
    signals to the ranks."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(runner.pid).children(recursive=True):
            if "deepspeed.launcher.launch" in " ".join(child.cmdline()):
                return child
        time.sleep(0.1)
    raise AssertionError("no deepspeed.launcher.launch process")


# exact_match, except that while the file HANG_FLAG names exists, one call takes it, starts a
# helper program, writes "<its pid> <the helper's pid>" to HANG_FLAG.hanging and hangs: a step that
# cannot end within the grace.
HANG_MODULE = """
import os, subprocess, time
from grpo_ds.rewards.builtin import exact_match as _exact_match

def exact_match(**kwargs):
    flag = os.environ["HANG_FLAG"]
    try:  # one call takes the flag: the workers score their chunks at once
        os.rename(flag, flag + ".taken")
    except FileNotFoundError:
        return _exact_match(**kwargs)
    helper = subprocess.Popen(["sleep", "600"])
    with open(flag + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    os.rename(flag + ".tmp", flag + ".hanging")
    time.sleep(600)
    return _exact_match(**kwargs)
"""
HANGING = ['reward.functions=[{"name": "hang_reward:exact_match"}]', "reward.timeout_s=600"]
# run.preempt_grace_s in these tests: long enough for a step and its checkpoint on a busy 2-core
# machine (the first stops must end normally, within 14 s: 4.7 s seen with four busy loops on the
# cores), short enough that waiting out a hanging step costs little
TEST_GRACE_S = 17
# an abandoned step waited for the step until ABANDON_LEAD_S before it
WAITED_S = TEST_GRACE_S - ABANDON_LEAD_S - 1


class HangingRun:
    """The tiny run of ``world`` ranks in ``tmp/run``, its reward able to hang on demand
    (``hang_next``)."""

    def __init__(self, tmp: Path, world: int) -> None:
        (tmp / "hang_reward.py").write_text(HANG_MODULE)
        self.flag, self.run_dir = tmp / "hang", tmp / "run" / "tiny_cpu"
        self.command = _command(
            world,
            tmp / "run",
            "checkpoint.every_steps=50",
            *HANGING,
            f"run.preempt_grace_s={TEST_GRACE_S}",
        )
        self.env = {
            **clean_env(),
            "HANG_FLAG": str(self.flag),
            "PYTHONPATH": f"{tmp}{os.pathsep}{REPO}",
        }

    def start(self) -> subprocess.Popen:
        return start_stoppable(self.command, REPO, self.env)

    def hang_next(self) -> None:
        self.flag.touch()

    def hanging(self, proc: subprocess.Popen) -> list[int]:
        """Wait until the reward hangs (the run still going); the pids of the reward worker and its
        helper."""
        marker = self.flag.with_name("hang.hanging")
        wait_for(marker.exists, proc)
        pids = [int(p) for p in marker.read_text().split()]
        marker.unlink()
        return pids

    def finish(self, stopped: int, reference_dir: Path, world: int) -> None:
        """The same command again: it resumes after ``stopped`` and ends as the uninterrupted run
        did."""
        resumed = subprocess.run(
            self.command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=900
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert f"resuming after step {stopped}" in resumed.stderr
        # every step once, as uninterrupted
        assert _renamed(_metrics(self.run_dir)) == _metrics(reference_dir)
        # the same samples trained at every step and the same final weights
        for rank in range(world):
            logs = [
                rank_log_records(folder / "ranks" / f"rank{rank}.jsonl")
                for folder in (self.run_dir, reference_dir)
            ]
            assert logs[0] == logs[1]


def _ranks(proc: subprocess.Popen, count: int = 2) -> list[psutil.Process]:
    """The launch's rank processes (the launcher's children that run grpo_ds.train)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = _launch_process(proc).children()
        ranks = [p for p in children if "grpo_ds.train" in " ".join(p.cmdline())]
        if len(ranks) == count:
            return ranks
        time.sleep(0.1)
    raise AssertionError(f"not {count} ranks")


def _renamed(metrics: dict[int, dict]) -> dict[int, dict]:
    """The hanging reward's metrics under the built-in's name (it returns the same scores)."""
    return {
        step: {k.replace("hang_reward:exact_match", "exact_match"): v for k, v in m.items()}
        for step, m in metrics.items()
    }


def _gone(pids: list[int]) -> bool:
    return all(gone(pid) for pid in pids)


def _ended(proc: subprocess.Popen, limit_s: float) -> tuple[float, str]:
    """Seconds until every process holding the run's stderr (its ranks, their reward workers and
    what those started) has ended, and the stderr; fails past ``limit_s``."""
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=limit_s + 60)
    took = time.monotonic() - signalled
    assert took < limit_s, f"{took:.1f} s:\n{err[-3000:]}"
    return took, err


def _stopped_with_checkpoint(
    run: HangingRun, err: str, how: str, code: int, proc: subprocess.Popen
) -> int:
    """The first stop: ``how`` after a step, with that step's checkpoint; returns the step."""
    assert proc.returncode == code, err[-3000:]
    stopped = _logged_steps(run.run_dir)
    assert f"{how}: stopped by " in err and f" after step {stopped} of {STEPS}" in err, err[-3000:]
    assert 3 <= stopped < STEPS, stopped  # the signal came mid-run
    assert checkpoint.latest_name(run.run_dir) == checkpoint.checkpoint_name(stopped)
    assert (
        checkpoint.verify(
            run.run_dir / checkpoint.CHECKPOINTS / checkpoint.checkpoint_name(stopped)
        )
        is None
    )
    return stopped


@pytest.mark.slow
def test_ctrl_c_and_a_sigterm_past_the_grace_each_stop_with_a_resumable_run(
    tmp_path, tmp_path_factory
):
    """One rank, four launches of one command: (1) a Ctrl-C mid-run stops after the step with its
    checkpoint, exit 130, no traceback; (2) resumed, a SIGTERM while the reward hangs
    (reward.timeout_s 600) abandons the step within run.preempt_grace_s, exit 75, naming that
    checkpoint, the worker and its helper killed; (3) resumed, the reward hangs again: a Ctrl-C
    asks, a second one stops at once, exit 130, no traceback; (4) resumed, the run ends with the
    uninterrupted run's metrics and samples."""
    reference_dir = reference_run(tmp_path_factory, 1) / "tiny_cpu"
    run = HangingRun(tmp_path, 1)
    proc = run.start()
    wait_for(lambda: _logged_steps(run.run_dir) >= 3, proc)
    proc.send_signal(signal.SIGINT)  # the run itself: wait_for saw it running
    _, err = _ended(proc, TEST_GRACE_S)
    stopped = _stopped_with_checkpoint(run, err, "interrupted", 130, proc)
    assert "Traceback" not in err, err[-3000:]
    latest = (
        "resumes from the checkpoint "
        f"{run.run_dir / checkpoint.CHECKPOINTS / checkpoint.checkpoint_name(stopped)}"
    )

    run.hang_next()
    proc = run.start()
    helpers = run.hanging(proc)
    proc.send_signal(signal.SIGTERM)
    took, err = _ended(proc, TEST_GRACE_S)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert (
        f"step {stopped + 1} did not end within "
        f"run.preempt_grace_s={TEST_GRACE_S}s and was abandoned" in err
    )
    assert latest in err and took > WAITED_S, (took, err[-3000:])
    assert _gone(helpers) and "Traceback" not in err

    run.hang_next()
    proc = run.start()
    helpers = run.hanging(proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    took, err = _ended(proc, 5.0)  # at once: no step, no checkpoint
    assert proc.returncode == 130, err[-3000:]
    assert "stopped at once by a second SIGINT" in err and latest in err, err[-3000:]
    assert _gone(helpers) and "Traceback" not in err
    assert checkpoint.latest_name(run.run_dir) == checkpoint.checkpoint_name(stopped)

    run.finish(stopped, reference_dir, 1)


@pytest.mark.slow
def test_two_ranks_stop_on_the_launchers_sigterm_and_within_the_grace_on_the_process_groups(
    tmp_path, tmp_path_factory
):
    """Two ranks through the `deepspeed` launcher: (0) a SIGTERM to the `deepspeed` command alone
    (``kill PID``, a container runtime's stop: DeepSpeed's runner forwards nothing on one node), and
    the ranks notice it is gone and stop after the step with its checkpoint, within the grace,
    nothing left running; (1) resumed, a SIGTERM to the launcher, as a scheduler sends it, stops
    after the step with its checkpoint; (2) resumed, rank 0's reward hangs, and a SIGTERM to the
    whole process group (``kill -TERM -PGID``: launcher and ranks at once) ends every process within
    run.preempt_grace_s, naming that checkpoint; (3) resumed, the run ends with the uninterrupted
    run's metrics and samples on both ranks."""
    reference_dir = reference_run(tmp_path_factory, 2) / "tiny_cpu"
    run = HangingRun(tmp_path, 2)
    proc = run.start()
    ranks = _ranks(proc)
    wait_for(lambda: _logged_steps(run.run_dir) >= 3, proc)
    proc.send_signal(signal.SIGTERM)  # the runner alone: it ends at once (143)
    _, err = _ended(proc, GRACE_S)
    assert _gone([r.pid for r in ranks])
    first = _stopped_with_checkpoint(run, err, "preempted", -signal.SIGTERM, proc)

    proc = run.start()
    launcher = _launch_process(proc)
    wait_for(lambda: _logged_steps(run.run_dir) >= first + 1, proc)
    launcher.send_signal(signal.SIGTERM)
    _, err = _ended(proc, GRACE_S)
    # A rank exits 75; DeepSpeed's launcher, once it has been signalled itself, exits 1 whatever its
    # ranks return.
    stopped = _stopped_with_checkpoint(run, err, "preempted", 1, proc)

    run.hang_next()
    proc = run.start()
    helpers = run.hanging(proc)
    ranks = _ranks(proc)
    # the runner, the launcher and both ranks (the reward workers have sessions)
    os.killpg(proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    while not _gone([r.pid for r in ranks]):
        assert time.monotonic() - signalled < TEST_GRACE_S, "the ranks outlived the grace"
        time.sleep(0.05)
    took = time.monotonic() - signalled
    # DeepSpeed's launcher leaves on its own schedule (up to 30 s)
    _, err = proc.communicate(timeout=60)
    assert (
        f"step {stopped + 1} did not end within "
        f"run.preempt_grace_s={TEST_GRACE_S}s and was abandoned" in err
    )
    assert (
        "resumes from the checkpoint "
        f"{run.run_dir / checkpoint.CHECKPOINTS / checkpoint.checkpoint_name(stopped)}" in err
    ), err[-3000:]
    assert took > WAITED_S and _gone(helpers), took

    run.finish(stopped, reference_dir, 2)


# grpo_ds.train called twice from Python, as a notebook does: the first call is interrupted by the
# test's SIGINT; the second one resumes with the reward hanging, and the same SIGINT's deadline
# abandons its step.
FROM_PYTHON = """
import json, sys
from pathlib import Path
import grpo_ds
from grpo_ds.run.preemption import StepAbandoned

recipe, overrides, flag = json.loads(sys.argv[1])
try:
    grpo_ds.train(recipe, overrides)
except KeyboardInterrupt as stopped:
    print("first:", type(stopped).__name__, stopped, flush=True)
Path(flag).touch()
try:
    grpo_ds.train(recipe, overrides + ["run.preempt_grace_s=4"])
except StepAbandoned as abandoned:
    print("second:", type(abandoned).__name__, abandoned, flush=True)
print("the caller goes on", flush=True)
"""


@pytest.mark.slow
def test_from_python_a_ctrl_c_raises_keyboard_interrupt_after_the_checkpoint_and_the_caller_lives_on(  # noqa: E501
    tmp_path,
):
    """grpo_ds.train(...) in a notebook's process: a SIGINT mid-run reaches the caller as
    KeyboardInterrupt once that step's checkpoint is written; called again, it resumes, its reward
    hangs, and a SIGINT's deadline abandons the step with StepAbandoned (a KeyboardInterrupt)
    instead of ending the process; the worker and its helper are gone."""
    run = HangingRun(tmp_path, 1)
    recipe, overrides = run.command[3], run.command[4:]
    proc = subprocess.Popen(
        [sys.executable, "-c", FROM_PYTHON, json.dumps([recipe, overrides, str(run.flag)])],
        cwd=REPO,
        env=run.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for(lambda: _logged_steps(run.run_dir) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    first = ""
    # other libraries print to stdout too
    while not first.startswith("first:") and proc.poll() is None:
        first = proc.stdout.readline()
    stopped = _logged_steps(run.run_dir)
    assert first.startswith(
        f"first: KeyboardInterrupt stopped by SIGINT after step {stopped} of {STEPS}"
    ), first
    assert stopped < STEPS and checkpoint.latest_name(run.run_dir) == checkpoint.checkpoint_name(
        stopped
    )

    helpers = run.hanging(proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert (
        f"second: StepAbandoned stopped by SIGINT: step {stopped + 1} did not end within "
        "run.preempt_grace_s=4s and was abandoned"
    ) in out, out + err[-3000:]
    assert out.endswith("the caller goes on\n") and _gone(helpers)


@pytest.mark.slow
def test_a_sigterm_during_a_checkpoint_write_lets_the_write_finish_and_stops_there(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    proc = subprocess.Popen(
        _command(1, tmp_path, "checkpoint.every_steps=4"),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    root = run_dir / checkpoint.CHECKPOINTS
    writing = []

    def being_written() -> bool:
        writing.extend(
            p.name for p in (root.iterdir() if root.exists() else ()) if p.name.startswith(".tmp-")
        )
        return bool(writing)

    wait_for(being_written, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    name = writing[0].removeprefix(checkpoint.TMP_PREFIX)
    # the checkpoint being written when the signal came, completed
    assert checkpoint.latest_name(run_dir) == name
    assert checkpoint.verify(root / name) is None
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert _logged_steps(run_dir) == int(name.removeprefix("step_"))  # and no step after it


def _signal_script(body: str, window_s: float | None = None) -> subprocess.CompletedProcess:
    """Run ``body`` inside stop_on_signals() in a fresh process; ``stop`` is the StopRequest."""
    window = "" if window_s is None else f"preemption.REPEAT_WINDOW_S = {window_s}\n"
    code = (
        f"import os, signal, time\nfrom grpo_ds.run import preemption\n{window}"
        "with preemption.stop_on_signals() as stop:\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "\nprint('after', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_the_first_signal_is_a_request_and_a_second_sigterm_stops_at_once():
    done = _signal_script(
        """
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        print("requested", stop.signal_name, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived", flush=True)""",
        window_s=0.0,
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "requested SIGTERM" in done.stdout and "survived" not in done.stdout
    assert "stopping after this step with a checkpoint" in done.stderr


def test_the_line_after_a_signal_sees_the_request():
    """Python's handler waits until the listening thread has taken the signal, so the main thread's
    next line sees the request (without that wait it printed None 10 times in 10: the listening
    thread had not run yet)."""
    done = _signal_script("""
        os.kill(os.getpid(), signal.SIGUSR1)
        print("at once", stop.signal_name, flush=True)""")
    assert done.returncode == 0, done.stderr
    assert "at once SIGUSR1" in done.stdout


def test_sigterms_within_the_repeat_window_are_one_request_and_sigusr1_never_kills():
    done = _signal_script("""
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1):  # the launcher's echo too
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
        print("requested", stop.signal_name, flush=True)""")  # noqa: E501
    assert done.returncode == 0, done.stderr
    assert "requested SIGUSR1" in done.stdout  # the first signal names the request
    assert "after True" in done.stdout  # the handlers that were there before are back
    assert done.stderr.count("received") == 1
