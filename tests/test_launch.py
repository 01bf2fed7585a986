"""``python -m grpo_ds.launch`` (grpo_ds/launch.py): DeepSpeed's command, with stops that end the
run. A SIGTERM to the command alone or to its process group stops every rank after the step with its
checkpoint, and the command returns 75 only once every process under it has ended; the same command
resumes with every step once, and ends at once on a finished run. A reward function's helper sees
nothing of a stop, under this command, under ``python -m grpo_ds.train`` and after a SIGTERM to the
plain ``deepspeed`` command alone. And the plain ``deepspeed`` command on 3 ranks (2 trainer + 1
rollout rank): a SIGTERM to it alone leaves no rank running past the grace."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo_ds.launch import exit_code
from grpo_ds.run import checkpoint
from tests.launch import (
    REPO,
    clean_env,
    free_port,
    gone,
    launch_command,
    remove_shm_buffers,
    start_stoppable,
    wait_for,
)

TINY = str(REPO / "recipes" / "tiny_cpu.json")
STEPS = 10
GRACE_S = 20  # run.preempt_grace_s here: a step and its checkpoint on a busy 2-core machine
ARGS = [
    f"train.steps={STEPS}",
    "rollout.prompts_per_step=8",
    "train.micro_batch_samples_per_gpu=32",
    "train.samples_per_optimizer_step=64",
    "logging.progress_bar=false",
    "checkpoint.every_steps=50",
    f"run.preempt_grace_s={GRACE_S}",
    'reward.functions=[{"name": "helper_reward:exact_match"}]',
]
SPLIT = ['rollout.placement="split"', "rollout.ranks=1"]

# exact_match, except that while the file HELPER_FLAG names exists, one call takes it (renames it
# away: two workers may find it at once) and runs a helper program for HELPER_S seconds, which
# writes the signals it receives to HELPER_FLAG.signals; HELPER_FLAG.running appears once the
# helper runs (a stop sent then arrives mid-call)
HELPER_S = 4
HELPER_MODULE = f"""
import os, subprocess, sys
from grpo_ds.rewards.builtin import exact_match as _exact_match

HELPER = '''
import signal, sys, time
from pathlib import Path
log = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda n, f: log.write_text(log.read_text() + "SIGTERM "))
signal.signal(signal.SIGINT, lambda n, f: log.write_text(log.read_text() + "SIGINT "))
log.write_text("")
Path(sys.argv[2]).touch()
end = time.monotonic() + {HELPER_S}
while time.monotonic() < end:
    time.sleep(0.05)
'''

def exact_match(**kwargs):
    flag = os.environ["HELPER_FLAG"]
    try:  # one call takes the flag: the workers score their chunks at once
        os.rename(flag, flag + ".taken")
    except FileNotFoundError:
        return _exact_match(**kwargs)
    subprocess.run([sys.executable, "-c", HELPER, flag + ".signals", flag + ".running"], check=True)
    return _exact_match(**kwargs)
"""


def test_the_exit_code_is_the_ranks_stop_or_failure():
    stop, ctrl_c, at_once = 75, 130, 143
    # every rank recorded
    assert exit_code([0, 0], 2, 0, None) == 0
    assert exit_code([stop, stop], 2, 75, signal.SIGTERM) == stop
    # a group SIGTERM killed DeepSpeed's runner; its launcher exited 1
    assert exit_code([stop, stop], 2, -signal.SIGTERM, signal.SIGTERM) == stop
    assert exit_code([stop, at_once], 2, 1, signal.SIGTERM) == at_once
    assert exit_code([ctrl_c, ctrl_c], 2, 1, signal.SIGINT) == ctrl_c
    # a refusal or a fault wins over a stop, the lowest rank's first
    assert exit_code([2, 2], 2, 2, None) == 2
    assert exit_code([stop, 3, 1], 3, 1, signal.SIGTERM) == 3
    # a rank that recorded nothing
    assert exit_code([0], 2, 1, None) == 1  # a traceback: DeepSpeed's code
    assert exit_code([0], 2, 0, None) == 1  # DeepSpeed's runner returns 0 for a killed launcher
    assert exit_code([stop], 2, 1, signal.SIGTERM) == stop  # killed on its way out after the stop
    assert exit_code([stop], 2, 1, None) == 1  # a stop no one asked this command for: a crash's
    assert exit_code([], 2, 241, signal.SIGTERM) == at_once  # killed before it could stop
    assert exit_code([], 0, -signal.SIGTERM, signal.SIGTERM) == at_once  # before any rank ran
    assert exit_code([], 0, 2, None) == 2  # DeepSpeed's runner refused its arguments


def test_help_names_deepspeeds_arguments():
    shown = subprocess.run(
        [sys.executable, "-m", "grpo_ds.launch", "--help"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("usage: python -m grpo_ds.launch"), shown.stdout
    assert "--num_gpus" in shown.stdout


class Run:
    """The tiny run in ``tmp/run`` on ``world`` ranks (1: ``python -m grpo_ds.train``), its reward
    able to run a helper on demand (``helper_next``); started by ``python -m grpo_ds.launch``, or
    by the plain ``deepspeed`` command (``plain``)."""

    def __init__(self, tmp: Path, world: int, *extra: str) -> None:
        (tmp / "helper_reward.py").write_text(HELPER_MODULE)
        self.tmp, self.world = tmp, world
        self.flag, self.run_dir = tmp / "helper", tmp / "run" / "tiny_cpu"
        self.args = [TINY, f"run.output_dir={tmp / 'run'}", *ARGS, *extra]
        self.env = {
            **clean_env(),
            "HELPER_FLAG": str(self.flag),
            "PYTHONPATH": f"{tmp}{os.pathsep}{REPO}",
        }
        self.ports: list[int] = []

    def command(self, plain: bool = False) -> list[str]:
        if self.world == 1:
            return [sys.executable, "-m", "grpo_ds.train", *self.args]
        self.ports.append(free_port())
        command = launch_command(
            self.world, ["--module", "grpo_ds.train", *self.args], self.ports[-1]
        )
        return command if plain else [sys.executable, "-m", "grpo_ds.launch", *command[1:]]

    def start(self, plain: bool = False) -> subprocess.Popen:
        return start_stoppable(self.command(plain), self.tmp, self.env)

    def run(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(), cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=600
        )

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line)["step"] for line in lines]

    def when_the_helper_runs(self, proc: subprocess.Popen) -> None:
        """Ask for the helper at the next reward call; return once it runs."""
        self.flag.touch()
        running = self.flag.with_name("helper.running")
        wait_for(running.exists, proc, poll_s=0.02)
        running.unlink()

    def the_helper_saw(self) -> str:
        return self.flag.with_name("helper.signals").read_text().strip()

    def clean(self) -> None:
        for port in self.ports:
            remove_shm_buffers(port)


def under(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def ended(proc: subprocess.Popen, watched: list[psutil.Process]) -> tuple[float, str]:
    """Seconds until the command returned (every process ``watched`` gone by then), and its
    stderr."""
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=GRACE_S + 60)
    took = time.monotonic() - signalled
    left = [p.pid for p in watched if not gone(p.pid)]
    assert not left, f"still running after the command returned: {left}\n{err[-3000:]}"
    return took, err


def stopped_with_checkpoint(run: Run, err: str) -> int:
    """The run stopped after a step with that step's checkpoint and said so; returns the step."""
    stopped = run.steps()[-1]
    assert f"preempted: stopped by SIGTERM after step {stopped} of {STEPS}" in err, err[-3000:]
    assert checkpoint.latest_name(run.run_dir) == checkpoint.checkpoint_name(stopped)
    assert "Traceback" not in err, err[-3000:]
    return stopped


def no_reward_failed(run: Run) -> None:
    path = run.run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["reward_errors/helper_reward:exact_match"] == 0, record


def stop_the_group_then_finish(run: Run, first: int) -> None:
    """Through ``python -m grpo_ds.launch``: resumed after ``first``, a SIGTERM to the command's
    process group a step later stops with 75 once every process under it has ended; resumed again,
    the run ends with every step once, exit 0; and once more, at once with exit 0."""
    proc = run.start()
    wait_for(lambda: len(run.steps()) >= first + 1, proc, poll_s=0.02)
    watched = under(proc)
    os.killpg(proc.pid, signal.SIGTERM)
    took, err = ended(proc, watched)
    assert proc.returncode == 75 and took < GRACE_S, (proc.returncode, took, err[-3000:])
    stopped_with_checkpoint(run, err)

    finished = run.run()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert run.steps() == list(range(1, STEPS + 1))
    no_reward_failed(run)
    again = run.run()
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr[-3000:]


@pytest.mark.slow
def test_a_stop_to_the_launch_command_ends_every_rank_first_then_75_and_the_run_resumes(tmp_path):
    """Two ranks through ``python -m grpo_ds.launch``: (1) a SIGTERM to the command alone while a
    reward helper runs: the step finishes with its rewards (the helper sees no signal), every rank
    stops with that step's checkpoint, and the command returns 75 after every process under it has
    ended, within the grace; (2) resumed, a SIGTERM to the command's process group (a scheduler's
    stop): the same; (3) resumed, the run ends with every step once, exit 0; (4) the same command on
    the finished run ends at once with exit 0."""
    run = Run(tmp_path, 2)
    try:
        proc = run.start()
        wait_for(lambda: len(run.steps()) >= 2, proc, poll_s=0.02)
        run.when_the_helper_runs(proc)
        watched = under(proc)
        proc.send_signal(signal.SIGTERM)
        took, err = ended(proc, watched)
        assert proc.returncode == 75 and took < GRACE_S, (proc.returncode, took, err[-3000:])
        first = stopped_with_checkpoint(run, err)
        assert run.the_helper_saw() == "", run.the_helper_saw()

        stop_the_group_then_finish(run, first)
    finally:
        run.clean()


@pytest.mark.slow
def test_a_reward_helper_sees_nothing_of_a_stop_under_python_m_grpo_ds_train(tmp_path):
    """One process, ``python -m grpo_ds.train``: a SIGTERM to its process group while a reward
    helper runs: the helper sees nothing, the step ends with its rewards and its checkpoint, exit
    75 (as under ``python -m grpo_ds.launch``, above)."""
    run = Run(tmp_path, 1)
    proc = run.start()
    wait_for(lambda: len(run.steps()) >= 2, proc, poll_s=0.02)
    run.when_the_helper_runs(proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = ended(proc, [])
    assert proc.returncode == 75, err[-3000:]
    stopped_with_checkpoint(run, err)
    assert run.the_helper_saw() == "", run.the_helper_saw()
    no_reward_failed(run)


@pytest.mark.slow
def test_three_ranks_split_a_sigterm_to_the_deepspeed_command_alone_stops_every_rank(tmp_path):
    """Split placement on 3 ranks (2 trainer + 1 rollout rank) through the plain ``deepspeed``
    command: (1) a SIGTERM to it alone (DeepSpeed's runner ends at once, forwarding nothing) while
    the rollout rank's reward helper runs: the ranks notice, the helper sees nothing, and every rank
    stops after the step with its checkpoint within the grace, nothing left running; (2) through
    ``python -m grpo_ds.launch``, resumed, a SIGTERM to its process group: 75 once every rank has
    ended; (3) resumed, every step once, exit 0; (4) again: ends at once, exit 0."""
    run = Run(tmp_path, 3, *SPLIT)
    try:
        proc = run.start(plain=True)
        wait_for(lambda: len(run.steps()) >= 2, proc, poll_s=0.02)
        run.when_the_helper_runs(proc)
        watched = under(proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGTERM  # DeepSpeed's runner: at once
        while not all(gone(p.pid) for p in watched):
            assert time.monotonic() - signalled < GRACE_S, "a rank outlived the grace"
            time.sleep(0.05)
        first = run.steps()[-1]
        assert checkpoint.latest_name(run.run_dir) == checkpoint.checkpoint_name(first)
        assert run.the_helper_saw() == "", run.the_helper_saw()

        stop_the_group_then_finish(run, first)
    finally:
        run.clean()
