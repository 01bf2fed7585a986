"""Several nodes, as a cluster runs them: two "nodes" of one rank each on this machine, each started
by DeepSpeed's launcher with the shared hostfile, ``--no_ssh`` and its ``--node_rank`` (what
docs/guides/clusters.md's sbatch script runs on every node through srun). They train as one node
with two ranks does; a SIGUSR1 to one rank (the scheduler's early warning, forwarded by the batch
script) stops both nodes at the same step with a checkpoint, and the same commands resume exactly; a
node that dies ends the job on the other one within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.launch import REPO, clean_env, deepspeed_program, free_port, remove_shm_buffers
from tests.test_resume import STEPS, reference_run
from tests.test_resume import _remove_shm_buffers as _remove_shm_buffers  # noqa: F401 - the module's fixture

# reference_run's runs are cached in tests/test_resume.py's module: its users share a worker
# (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reference_run")]

TINY = str(REPO / "recipes" / "tiny_cpu.json")
ARGS = [
    "rollout.prompts_per_step=8",
    "train.micro_batch_samples_per_gpu=32",
    "train.samples_per_optimizer_step=64",
    "logging.progress_bar=false",
    "checkpoint.every_steps=50",
]
EXIT_PREEMPTED = 75


def node_commands(out: Path, port: int, hostfile: Path, *extra: str) -> list[list[str]]:
    """One launcher command per node: the shared hostfile, no ssh, the node's rank, the first node's
    address."""
    return [
        [
            deepspeed_program(),
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "--module",
            "grpo_ds.train",
            TINY,
            f"run.output_dir={out}",
            *ARGS,
            *extra,
        ]
        for node in range(2)
    ]


def start_nodes(out: Path, *extra: str) -> tuple[list[subprocess.Popen], int]:
    """Both nodes' launchers, each in its own session (a node's processes are signalled together);
    their output goes to <out>.node<i>.log."""
    hostfile = out.parent / f"{out.name}.hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = free_port()
    procs = []
    for node, cmd in enumerate(node_commands(out, port, hostfile, *extra)):
        with open(out.parent / f"{out.name}.node{node}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=clean_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        procs[-1].log = out.parent / f"{out.name}.node{node}.log"
    return procs, port


def finish(procs: list[subprocess.Popen], port: int, timeout: float = 600) -> list[tuple[int, str]]:
    """Each node's exit code and output; whatever still runs after ``timeout`` is killed."""
    try:
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return [(code, proc.log.read_text()) for code, proc in zip(codes, procs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        remove_shm_buffers(port)


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without what measures time or memory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not (k.startswith("time_") or "per_s" in k or "memory" in k)}
        for r in rows
    ]


def rank_process(proc: subprocess.Popen) -> psutil.Process:
    """A node's training rank (the child its launcher started with -m grpo_ds.train)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if "-m" in cmd and cmd[cmd.index("-m") + 1 : cmd.index("-m") + 2] == ["grpo_ds.train"]:
                return child
        time.sleep(0.1)
    raise AssertionError("no rank process")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> list[dict]:
    """12 steps on two nodes of one rank each, start to end."""
    out = tmp_path_factory.mktemp("two_nodes")
    procs, port = start_nodes(out, f"train.steps={STEPS}")
    for code, err in finish(procs, port):
        assert code == 0, err[-4000:]
    return metrics(out / "tiny_cpu")


def test_two_nodes_train_as_one_node_with_two_ranks(tmp_path_factory, two_nodes):
    # One node with two ranks: test_resume's uninterrupted 12-step run of the same recipe through
    # `deepspeed --num_gpus 2` (shared with the tests that resume it; it checkpoints every 2 steps,
    # which changes no step)
    one_node = reference_run(tmp_path_factory, 2)
    assert metrics(one_node / "tiny_cpu") == two_nodes


def test_a_sigusr1_to_one_rank_stops_both_nodes_with_a_checkpoint_and_they_resume_exactly(
    tmp_path, two_nodes
):
    procs, port = start_nodes(tmp_path, f"train.steps={STEPS}")
    log = tmp_path / "tiny_cpu" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.01)
        # node 1's rank only: the ranks agree to stop
        rank_process(procs[1]).send_signal(signal.SIGUSR1)
    finally:
        results = finish(procs, port)
    stopped = len(log.read_text().splitlines())
    for code, err in results:
        assert code == EXIT_PREEMPTED, err[-3000:]  # each node's launcher returns its rank's code
    assert f"preempted: stopped by SIGUSR1 after step {stopped} of {STEPS}" in results[0][1]
    assert (tmp_path / "tiny_cpu" / "checkpoints" / f"step_{stopped:08d}").is_dir()
    procs, port = start_nodes(tmp_path, f"train.steps={STEPS}")  # the same commands again
    for code, err in finish(procs, port):
        assert code == 0, err[-3000:]
    assert metrics(tmp_path / "tiny_cpu") == two_nodes


def test_a_node_that_dies_ends_the_job_on_the_other_within_seconds(tmp_path):
    procs, port = start_nodes(tmp_path, "train.steps=2000")
    log = tmp_path / "tiny_cpu" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1 is gone: its launcher and its rank
        died = time.monotonic()
        code = procs[0].wait(timeout=120)
        took = time.monotonic() - died
    finally:
        finish(procs, port, timeout=5)
    assert code != 0 and took < 30, f"node 0 ended {took:.1f} s later with exit {code}"
