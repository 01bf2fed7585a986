"""Durable runs: SIGKILL at random moments (in a step, in a checkpoint write), resume, same metrics,
with and without CPU offload; damaged checkpoints are reported and skipped; the run folder refuses
another recipe's run.

Run as a module (``python -m tests.test_resume RECIPE OVERRIDES...``, also under the ``deepspeed``
launcher), this file is grpo_ds.train that also records what DeepSpeed built for the policy (see
``_train_recording_offload``)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_ds.run import checkpoint
from tests.launch import (
    REPO,
    clean_env,
    free_port,
    launch_command,
    rank_log_records,
    remove_shm_buffers,
)

# reference_run() caches its runs in this module for the session; its users here, in
# tests/run/test_preemption.py and tests/test_clusters.py share one worker under pytest-xdist, so
# each run is made once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("reference_run")

TINY = str(REPO / "recipes" / "tiny_cpu.json")
STEPS = 12
# Small and deterministic: fixed seed, CPU fp32, no dropout; every step's rollout seed comes from
# the step.
ARGS = [
    f"train.steps={STEPS}",
    "checkpoint.every_steps=2",
    "checkpoint.keep=2",
    "run.overwrite=false",
    "rollout.prompts_per_step=8",
    "train.micro_batch_samples_per_gpu=32",
    "train.samples_per_optimizer_step=64",
    "logging.progress_bar=false",
]
# Wall-clock and memory figures differ between attempts; everything else must be identical.
VOLATILE = ("time_", "tokens_per_s", "generated_tokens_per_s", "peak_memory_gib")
# What DeepSpeed must have built for the policy with each offload config (recorded by
# _train_recording_offload): the optimizer class, DeepSpeed's ZeRO-3 offload flags, and whether
# every parameter partition lives in the flat CPU buffer that ZeRO-3 allocates only for parameter
# offload. On the CPU accelerator nothing crosses a device boundary: this proves the offload code
# paths (DeepSpeedCPUAdam, the offloaded partitions) ran.
# folder the recording entry point writes one JSON per process into
OFFLOAD_RECORD = "GRPO_DS_TEST_OFFLOAD_RECORD"
OFFLOAD = {
    "ds_configs/zero3_offload_optimizer.json": {
        "optimizer": "DeepSpeedCPUAdam",
        "offload_optimizer": True,
        "offload_param": False,
        "partitions_in_cpu_offload_buffer": False,
    },
    "ds_configs/zero3_offload.json": {
        "optimizer": "DeepSpeedCPUAdam",
        "offload_optimizer": True,
        "offload_param": True,
        "partitions_in_cpu_offload_buffer": True,
    },
}


# this module's multi-rank runs; their shared-memory buffers are removed at the end
PORTS: list[int] = []


@pytest.fixture(autouse=True, scope="module")
def _remove_shm_buffers():
    yield
    for port in PORTS:
        remove_shm_buffers(port)


@pytest.fixture(scope="session")
def cpu_adam_built():
    """DeepSpeed's CPU Adam (what an offloaded optimizer runs) is compiled with g++ on first use,
    about 100 s on 2 cores, and cached in ~/.cache/torch_extensions. Build it once here, so that no
    timed or killed run pays for it and concurrent ranks do not queue on torch's build lock; with a
    warm cache this takes seconds."""
    code = (
        "from deepspeed.accelerator import get_accelerator as "
        "a; a().create_op_builder('CPUAdamBuilder').load()"
    )
    built = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr[-4000:]


# (world, deepspeed) -> its output folder, for the session
_REFERENCES: dict[tuple[int, str | None], Path] = {}


def reference_run(
    factory: pytest.TempPathFactory, world: int, deepspeed: str | None = None
) -> Path:
    """One uninterrupted STEPS-step run of the tiny recipe (ARGS) per world size and DeepSpeed
    config, made the first time a test asks and read by every test after (SIGKILL, preemption,
    world-size move, refusals): each launch costs 10-20 s, and the same command gives the same run.
    Returns its run.output_dir (the run folder is tiny_cpu in it; with a DeepSpeed config, the
    offload records are in its "offload"). Tests only read it, or launch commands that are refused
    before they write anything."""
    key = (world, deepspeed)
    if key not in _REFERENCES:
        out = factory.mktemp(f"reference-{world}-{Path(deepspeed or 'default').stem}")
        env = clean_env()
        if deepspeed is not None:
            env[OFFLOAD_RECORD] = str(out / "offload")
        done = subprocess.run(
            _command(world, out, deepspeed),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert len(_metrics(out / "tiny_cpu")) == STEPS
        _REFERENCES[key] = out
    return _REFERENCES[key]


def _command(world: int, out: Path, deepspeed: str | None = None) -> list[str]:
    """The tiny run; with a DeepSpeed config, through this file's recording entry point (see
    OFFLOAD)."""
    module, extra = (
        ("grpo_ds.train", [])
        if deepspeed is None
        else ("tests.test_resume", [f"deepspeed={deepspeed}"])
    )
    if world == 1:
        return [sys.executable, "-m", module, TINY, f"run.output_dir={out}", *ARGS, *extra]
    PORTS.append(free_port())
    return launch_command(
        world, ["--module", module, TINY, f"run.output_dir={out}", *ARGS, *extra], PORTS[-1]
    )


def _metrics(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(records) + 1)), f"steps logged {steps}"
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records}


def _optimizer_state(run_dir: Path) -> dict[str, object]:
    """Every value in the optimizer shards (ds/*_optim_states.pt) of the run's newest checkpoint,
    by file and key path: Adam's moments and step count, ZeRO's fp32 master weights, the layout's
    numbers."""
    newest = checkpoint.complete_checkpoints(run_dir)[0]
    values: dict[str, object] = {"checkpoint": newest.name}

    def walk(obj, path: str) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}/{key}")
        elif isinstance(obj, list | tuple):
            for i, value in enumerate(obj):
                walk(value, f"{path}/{i}")
        elif isinstance(obj, torch.Tensor | int | float | str):
            values[path] = obj

    for shard in sorted((newest / checkpoint.DS_TAG).glob("*_optim_states.pt")):
        walk(torch.load(shard, map_location="cpu", weights_only=False), shard.name)
    return values


def _assert_same_optimizer_state(run_dir: Path, reference_dir: Path) -> None:
    """The newest checkpoint's optimizer state equals the uninterrupted run's, bit for bit."""
    got, expected = _optimizer_state(run_dir), _optimizer_state(reference_dir)
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    differ = []
    for path, want in expected.items():
        have = got[path]
        if isinstance(want, torch.Tensor):
            if torch.equal(have, want):
                continue
            differ.append(
                f"{path} = {have.item()}, not {want.item()}"
                if want.numel() == 1
                else f"{path}: {(have != want).sum().item()} of {want.numel()} differ"
            )
        elif have != want:
            differ.append(f"{path} = {have!r}, not {want!r}")
    assert not differ, "the optimizer state is not the uninterrupted run's: " + "; ".join(differ)


def _logged_steps(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _kill_when(proc: subprocess.Popen, condition, limit_s: float = 300) -> bool:
    """SIGKILL the whole process group once condition() holds; False if the process ended first."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "deepspeed"),
    [
        # One rank (ZeRO stage 1), and offloaded parameters and optimizer state partitioned over two
        # ranks (ZeRO-3, each rank writing its own shards, so a write torn across ranks). Each case
        # costs three launches (60-100 s), so two more are left out: two ranks without offload (the
        # second case less the offload; its SIGTERM resume is checked exact in
        # tests/run/test_preemption.py) and one rank with only the optimizer offloaded.
        (1, None),
        (2, "ds_configs/zero3_offload.json"),
    ],
)
def test_sigkill_anywhere_then_resume_gives_the_uninterrupted_metrics(
    tmp_path, tmp_path_factory, request, world, deepspeed
):
    env = clean_env()
    if deepspeed is not None:
        request.getfixturevalue("cpu_adam_built")
        env[OFFLOAD_RECORD] = str(tmp_path / "offload")
    reference = reference_run(tmp_path_factory, world, deepspeed)
    expected = _metrics(reference / "tiny_cpu")

    run_dir = tmp_path / "crashy" / "tiny_cpu"
    rng = random.Random(world)
    kills = {"in_step": 0, "in_checkpoint_write": 0}
    # Kill plan: inside a step (after a random number of logged steps, plus a random delay), then,
    # in the run that resumed from that, inside a checkpoint write (the moment a .tmp- folder
    # appears); the run after resumes past the torn write from a run that had itself resumed.
    plan = ["in_step", "in_checkpoint_write"]
    for attempt in range(12):
        proc = subprocess.Popen(
            _command(world, tmp_path / "crashy", deepspeed),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if attempt < len(plan):
            kind = plan[attempt]
            if kind == "in_step":
                # past the step-2 checkpoint: the next run resumes from a checkpoint, not from the
                # start
                target = max(_logged_steps(run_dir), 2) + rng.randint(1, 3)
                delay = rng.uniform(0.0, 0.05)
                started = [None]

                def reached(target=target, delay=delay, started=started):
                    if _logged_steps(run_dir) >= target and started[0] is None:
                        started[0] = time.monotonic()
                    return started[0] is not None and time.monotonic() - started[0] >= delay

                killed = _kill_when(proc, reached)
            else:
                root = run_dir / checkpoint.CHECKPOINTS
                before = set(root.glob("step_*")) if root.exists() else set()

                def writing(root=root, before=before):
                    return (
                        root.exists()
                        and any(p.name.startswith(checkpoint.TMP_PREFIX) for p in root.iterdir())
                        and set(root.glob("step_*")) == before
                    )

                killed = _kill_when(proc, writing)
            if killed:
                kills[kind] += 1
                continue
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        assert "resuming after step" in err, err[-4000:]  # the finishing run continued a checkpoint
        break
    assert kills["in_step"] >= 1 and kills["in_checkpoint_write"] >= 1, kills
    # The optimizer's state first, from the newest checkpoints: Adam's moments and step count
    # are the uninterrupted run's. A resume that loses them changes the metrics only through
    # the updates after it; this names the cause, whatever the recipe's updates are.
    _assert_same_optimizer_state(run_dir, reference / "tiny_cpu")
    got = _metrics(run_dir)
    assert got == expected
    # each rank's log holds every step once (trimmed on resume), as uninterrupted
    for rank in range(world):
        logs = [
            rank_log_records(folder / "ranks" / f"rank{rank}.jsonl")
            for folder in (run_dir, reference / "tiny_cpu")
        ]
        assert [r.get("step") for r in logs[0]] == [*range(1, STEPS + 1), None]
        # the same samples trained at every step, and the same final weights
        assert logs[0] == logs[1]
    # every process that built its policy (reference, killed and resumed) offloaded
    if deepspeed is not None:
        records = [
            json.loads(p.read_text())
            for folder in (reference, tmp_path)
            for p in sorted((folder / "offload").glob("*.json"))
        ]
        # at least the reference's and the finishing run's, plus each killed attempt that got that
        # far
        assert (
            sorted({r.pop("rank") for r in records}) == list(range(world))
            and len(records) >= 2 * world
        ), records
        assert all(r == OFFLOAD[deepspeed] for r in records), records


@pytest.mark.slow
def test_a_damaged_checkpoint_is_reported_and_the_previous_one_is_used(tmp_path):
    out = tmp_path / "runs"
    args = [sys.executable, "-m", "grpo_ds.train", TINY, f"run.output_dir={out}", *ARGS]
    first = subprocess.run(
        [*args[: -len(ARGS)], *ARGS, "train.steps=4"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert first.returncode == 0, first.stderr[-4000:]
    root = out / "tiny_cpu" / checkpoint.CHECKPOINTS
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004"]
    shard = next(p for p in sorted((root / "step_00000004" / "ds").rglob("*.pt")))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    resumed = subprocess.run(
        [*args, "train.steps=6"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    name = shard.relative_to(root / "step_00000004").as_posix()
    assert (
        f"checkpoint step_00000004 is damaged: {name} does not match its sha256" in resumed.stderr
    )
    assert "resuming after step 2 from" in resumed.stderr
    steps = [
        json.loads(line)["step"]
        for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    # steps 3 and 4 were redone after the fallback, not logged twice
    assert steps == [1, 2, 3, 4, 5, 6]


def test_verify_names_an_altered_file(tmp_path):
    ckpt = tmp_path / "step_00000001"
    shard = ckpt / "ds" / "mp_rank_00_model_states.pt"
    shard.parent.mkdir(parents=True)
    torch.save({"weights": torch.ones(3)}, shard)
    manifest = {"step": 1, "files": {"ds/mp_rank_00_model_states.pt": checkpoint._sha256(shard)}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(ckpt) is None
    shard.write_bytes(shard.read_bytes()[:-1] + b"z")
    assert checkpoint.verify(ckpt).startswith(
        "ds/mp_rank_00_model_states.pt does not match its sha256"
    )
    shard.unlink()
    assert checkpoint.verify(ckpt) == "ds/mp_rank_00_model_states.pt is missing"


@pytest.mark.slow
def test_another_recipes_run_folder_is_refused(tmp_path_factory):
    # refused before anything is written: the shared run is not touched
    out = reference_run(tmp_path_factory, 1)
    before = {p: p.read_bytes() for p in (out / "tiny_cpu").rglob("*") if p.is_file()}
    base = [sys.executable, "-m", "grpo_ds.train", TINY, f"run.output_dir={out}", *ARGS]
    other = subprocess.run(
        [*base, "train.lr=0.5"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert other.returncode == 2
    assert (
        other.stderr.strip().splitlines()[-1].startswith("error: run.name: the run folder ")
        and "holds another recipe's run (train.lr was 0.001" in other.stderr
    )
    never = subprocess.run(
        [*base, "checkpoint.resume=never"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert never.returncode == 2 and "already holds a run" in never.stderr
    assert {p: p.read_bytes() for p in (out / "tiny_cpu").rglob("*") if p.is_file()} == before


def _train_recording_offload(folder: Path) -> None:
    """grpo_ds.train (command line as given) that writes, for each policy engine DeepSpeed builds in
    this process, folder/<rank>-<pid>.json with the facts OFFLOAD lists, read from DeepSpeed's own
    objects."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from grpo_ds.train import main

    initialize = deepspeed.initialize

    def recording(*args, **kwargs):
        built = initialize(*args, **kwargs)
        engine = built[0]
        # the policy (a KL reference engine has no optimizer)
        if kwargs.get("model_parameters") is not None:
            zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3; .optimizer is the one it steps
            buffers = [
                (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
                for b in zero.param_groups_fp16_flat_cpu_memory
            ]
            partitions = [p.ds_tensor for p in engine.module.parameters() if p.requires_grad]
            record = {
                "rank": engine.global_rank,
                "optimizer": type(zero.optimizer).__name__
                if isinstance(zero.optimizer, DeepSpeedCPUAdam)
                else f"not DeepSpeedCPUAdam: {type(zero.optimizer).__name__}",
                "offload_optimizer": zero.offload_optimizer,
                "offload_param": zero.offload_param,
                "partitions_in_cpu_offload_buffer": bool(partitions)
                and all(any(lo <= t.data_ptr() < hi for lo, hi in buffers) for t in partitions),
            }
            path = folder / f"{record['rank']}-{os.getpid()}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record))
            # whole or absent, whenever the process is killed
            path.with_suffix(".tmp").replace(path)
        return built

    folder.mkdir(parents=True, exist_ok=True)
    deepspeed.initialize = recording
    main()


if __name__ == "__main__":
    _train_recording_offload(Path(os.environ[OFFLOAD_RECORD]))


def _close(got: dict[int, dict], expected: dict[int, dict], moved_steps: set[int]) -> None:
    """The same steps with the same counts and samples, and every number equal to float rounding
    (gradients are reduced in another order at another world size: the layout tests' exactness, not
    bit equality). The steps in ``moved_steps`` ran at another world size than ``expected``, so the
    metric that describes the layout may differ there."""
    assert got.keys() == expected.keys()
    for step in expected:
        for key, value in expected[step].items():
            if key == "token_imbalance" and step in moved_steps:
                continue
            if isinstance(value, float):
                assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
            else:
                assert got[step][key] == value, (step, key)


def _train(world: int, out: Path, steps: int) -> str:
    command = [
        f"train.steps={steps}" if arg.startswith("train.steps=") else arg
        for arg in _command(world, out)
    ]
    done = subprocess.run(
        command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


@pytest.mark.slow
def test_a_run_resumes_on_another_world_size_as_if_it_had_run_there(tmp_path, tmp_path_factory):
    """Samples do not depend on the rank layout and the numbers are exact across it, so one
    uninterrupted run on one rank is the reference for a run that moves 2 -> 1 -> 2 ranks (ZeRO-3 on
    two, stage 1 on one) through DeepSpeed's universal checkpoints: every step, before and after
    each move, equals it."""
    expected = _metrics(reference_run(tmp_path_factory, 1) / "tiny_cpu")
    moved = tmp_path / "moved"
    legs = [(2, STEPS // 3), (1, 2 * STEPS // 3), (2, STEPS)]
    _train(legs[0][0], moved, legs[0][1])
    for (before, done), (after, steps) in zip(legs[:-1], legs[1:], strict=True):
        stderr = _train(after, moved, steps)
        assert f"was written by {before} ranks; loading it on {after}" in stderr
        assert f"resuming after step {done}" in stderr
    on_two = {*range(1, STEPS // 3 + 1), *range(2 * STEPS // 3 + 1, STEPS + 1)}
    _close(_metrics(moved / "tiny_cpu"), expected, moved_steps=on_two)


@pytest.mark.slow
def test_a_layout_that_cannot_move_says_so_before_anything_loads(tmp_path_factory, cpu_adam_built):
    """ZeRO offload (like tensor and sequence parallelism) changes what a partition is: resuming
    such a run on another world size is one line, exit 2, before any model loads."""
    offload = "ds_configs/zero3_offload.json"
    # refused before anything is written: not touched
    out = reference_run(tmp_path_factory, 2, offload)
    before = {p: p.read_bytes() for p in (out / "tiny_cpu").rglob("*") if p.is_file()}
    moved = subprocess.run(
        [*_command(1, out), f"train.steps={STEPS + 2}", f"deepspeed={offload}"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert moved.returncode == 2, moved.stderr[-3000:]
    errors = [line for line in moved.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: world size: the run in")
    assert (
        "was checkpointed at world size 2 and resumes at 1, which ZeRO offload optimizer to cpu"
        in errors[0]
    )
    assert {p: p.read_bytes() for p in (out / "tiny_cpu").rglob("*") if p.is_file()} == before
