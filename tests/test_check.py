"""grpo_ds.check: the dry run validates a recipe for a world size and prints the batch plan, loading
no model."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_ds import check
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.software import VLLM_SPEC
from grpo_ds.run.preflight import prepare_inputs
from tests.scripts.cli_forks import Finished, run_forked

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_cpu.json"
RANK_LINE = re.compile(
    r"^\s+rank\s+(\d+):\s+(\d+) samples\s+(\d+) tokens\s+(\d+) update micro-batches "
    r"\((\d+) padding\)\s+(\d+) log-prob micro-batches$",
    re.MULTILINE,
)

# name -> arguments after the recipe path
RUNS = {
    "world3": ["--world-size", "3"],
    "world2_minibatches": ["--world-size", "2", "train.samples_per_optimizer_step=200"],
    # dynamic batching needs a cap >= max_prompt_tokens + max_new_tokens; arith prompts are a few
    # tokens
    "dynamic": [
        "train.max_tokens_per_micro_batch=64",
        "--lengths",
        "max",
        "data.max_prompt_tokens=16",
    ],
}


def rank_lines(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in m) for m in RANK_LINE.findall(text)]


def line_of(text: str, label: str) -> str:
    found = [line for line in text.splitlines() if line.strip().startswith(label)]
    assert len(found) == 1, f"no single line {label!r} in:\n{text}"
    return found[0]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Finished]:
    """Each of RUNS as `python -m grpo_ds.check` in an empty folder, forked from one process that
    imported the libraries (tests/scripts/cli_forks.py);
    test_a_layout_split_placement_cannot_run_is_one_line_and_exit_2 starts a plain one."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    workdirs = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    finished = run_forked(
        [(["grpo_ds.check", str(RECIPE), *RUNS[name]], workdirs[name]) for name in RUNS],
        env,
        tmp_path_factory.mktemp("forks"),
        timeout=300,
    )
    for name, proc in zip(RUNS, finished, strict=True):
        proc.workdir_files = sorted(workdirs[name].iterdir())  # the dry run writes nothing
    return dict(zip(RUNS, finished, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_check_succeeds_quietly(outputs, name):
    proc = outputs[name]
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    assert proc.workdir_files == []


@pytest.mark.slow
def test_world_size_3_plan(outputs):
    out = outputs["world3"].stdout
    r = load_recipe(RECIPE)
    samples = r.rollout.prompts_per_step * r.rollout.group_size
    assert samples == 800
    assert "\n\nrecipe is valid for world size 3\n" in out  # after the environment block
    assert re.search(rf"samples per step\s+{samples} = prompts_per_step 25 x group_size 32", out)
    assert re.search(
        rf"optimizer steps per rollout\s+1 = {samples} / {samples} x epochs_per_rollout 1", out
    )
    assert "skipped" in line_of(out, "old-log-prob pass")

    ranks = rank_lines(out)
    assert [rank[0] for rank in ranks] == [0, 1, 2]
    assert sum(rank[1] for rank in ranks) == samples  # 800 does not divide by 3; nothing is lost
    # every rank runs the same number of update micro-batches
    assert len({rank[3] for rank in ranks}) == 1
    imbalance = float(line_of(out, "token imbalance").rsplit(" ", 1)[1])
    assert 1.0 <= imbalance < 1.1

    micro = r.train.micro_batch_samples_per_gpu
    gas = math.ceil(math.ceil(samples / 3) / micro)
    assert (micro, gas) == (400, 1)  # 267 samples on the fullest rank fit in one micro-batch
    assert re.search(rf"train_micro_batch_size_per_gpu\s+{micro}\n", out)
    assert re.search(rf"gradient_accumulation_steps\s+{gas} ", out)
    assert re.search(
        rf"train_batch_size\s+{micro * gas * 3} = {micro} x {gas} x world size 3\n", out
    )


@pytest.mark.slow
def test_several_optimizer_steps_run_the_old_logprob_pass(outputs):
    out = outputs["world2_minibatches"].stdout
    assert "\n\nrecipe is valid for world size 2\n" in out  # --world-size mixed with overrides
    assert re.search(r"samples per optimizer step\s+200\n", out)
    assert re.search(r"optimizer steps per rollout\s+4 = 800 / 200", out)
    assert "runs" in line_of(out, "old-log-prob pass")
    ranks = rank_lines(out)
    # shards of the first optimizer step
    assert len(ranks) == 2 and sum(rank[1] for rank in ranks) == 200
    micro = load_recipe(RECIPE).train.micro_batch_samples_per_gpu
    gas = math.ceil(math.ceil(200 / 2) / micro)
    assert re.search(
        rf"train_batch_size\s+{micro * gas * 2} = {micro} x {gas} x world size 2\n", out
    )


@pytest.mark.slow
def test_dynamic_batching_is_shown(outputs):
    out = outputs["dynamic"].stdout
    # packed: real tokens
    assert "<= 64 real tokens (dynamic)" in line_of(out, "update micro-batch")
    assert "<= 64 real tokens (dynamic)" in line_of(out, "log-prob micro-batch")
    ((_, samples, _, update_mbs, _, _),) = rank_lines(out)
    assert samples == 800
    # a 64-token cap splits finer than the 100-sample micro-batches would
    assert update_mbs > 800 // 100


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_report_shards_cover_every_sample(world_size):
    inputs = prepare_inputs(RECIPE, None, world_size, "cpu")
    out = check.report(inputs, world_size, "max")
    r = inputs.recipe
    ranks = rank_lines(out)
    assert [rank[0] for rank in ranks] == list(range(world_size))
    assert sum(rank[1] for rank in ranks) == r.rollout.prompts_per_step * r.rollout.group_size
    # equal micro-batch count on every rank (ZeRO-3 collectives)
    assert len({rank[3] for rank in ranks}) == 1
    assert inputs.ds_config["train_batch_size"] == (
        inputs.ds_config["train_micro_batch_size_per_gpu"]
        * inputs.ds_config["gradient_accumulation_steps"]
        * world_size
    )


def test_report_with_overrides_in_process():
    inputs = prepare_inputs(
        RECIPE, ["train.samples_per_optimizer_step=100", "train.epochs_per_rollout=2"], 2, "cpu"
    )
    out = check.report(inputs, 2, "uniform")
    assert re.search(r"optimizer steps per rollout\s+16 = 800 / 100 x epochs_per_rollout 2", out)
    assert sum(rank[1] for rank in rank_lines(out)) == 100


def test_a_column_named_like_a_reward_argument_is_caught_before_any_model_loads(tmp_path):
    from grpo_ds.errors import UserError

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2", "completions": "x"}\n')
    with pytest.raises(UserError) as err:
        prepare_inputs({"data": {"train": str(data)}}, None, 1, "cpu")
    assert err.value.where == "data" and "'completions'" in err.value.what


def test_kernels_backend_is_resolved_before_any_model_loads(monkeypatch):
    from grpo_ds.errors import UserError

    assert prepare_inputs(RECIPE, None, 1, "cpu").kernels_backend == "torch"  # auto on CPU
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError) as err:
        prepare_inputs(RECIPE, ["kernels.backend=triton"], 1, "cpu")
    assert str(err.value).startswith("kernels.backend 'triton': ")
    assert 'Set kernels.backend to "auto" or "torch"' in str(err.value)
    # Triton's interpreter makes it runnable on CPU (slowly)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if importlib.util.find_spec("triton") is not None:
        assert (
            prepare_inputs(RECIPE, ["kernels.backend=triton"], 1, "cpu").kernels_backend == "triton"
        )


def test_report_says_when_importance_weights_need_the_old_logprob_pass():
    inputs = prepare_inputs(RECIPE, ["algorithm.rollout_is_cap=2"], 1, "cpu")
    assert (
        "old-log-prob pass            runs (importance weights (algorithm.rollout_is_cap) need the "
        "policy's log-probs at sampling time)" in check.report(inputs, 1, "uniform")
    )


def test_report_shows_the_tensor_parallel_layout_and_refuses_impossible_ones():
    from grpo_ds.errors import UserError

    inputs = prepare_inputs(RECIPE, ["train.tensor_parallel_size=2"], 4, "cpu")
    out = check.report(inputs, 4, "uniform")
    assert "world size 4 = data parallel 2 x tensor parallel 2" in out
    assert len(rank_lines(out)) == 2  # one line per data-parallel rank
    assert (
        "left out (AutoTP under ZeRO-3" in out
        and "full logits (tensor parallelism splits the lm_head)" in out
    )
    with pytest.raises(UserError) as err:  # tiny_num_heads is 4
        prepare_inputs(RECIPE, ["train.tensor_parallel_size=3"], 3, "cpu")
    assert err.value.where == "train.tensor_parallel_size" and "tiny_num_heads" in err.value.what


def test_tensor_parallel_size_must_divide_a_saved_models_heads(tmp_path):
    from grpo_ds.errors import UserError
    from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=4).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(UserError) as err:
        prepare_inputs(RECIPE, [f"model.path={tmp_path}", "train.tensor_parallel_size=3"], 3, "cpu")
    assert err.value.where == "train.tensor_parallel_size" and "4 attention heads" in err.value.what
    assert prepare_inputs(
        RECIPE, [f"model.path={tmp_path}", "train.tensor_parallel_size=2"], 2, "cpu"
    )


@pytest.mark.slow
def test_the_dry_run_prints_the_environment_first(outputs):
    from importlib.metadata import version

    out = outputs["world3"].stdout
    assert "\nenvironment\n" in "\n" + out and out.index("environment\n") < out.index(
        "recipe is valid"
    )
    assert line_of(out, "python ") == f"  python        {sys.version.split()[0]}"
    assert line_of(out, "torch ").startswith(f"  torch         {version('torch')} (")
    assert line_of(out, "deepspeed ") == f"  deepspeed     {version('deepspeed')}"
    # the test environment: DS_ACCELERATOR=cpu
    assert line_of(out, "accelerator ").startswith("  accelerator   CPU (")
    assert "extras        installed: " in out


def test_environment_block_on_a_gpu_machine():
    from grpo_ds.config.software import PACKAGES, InstalledSoftware, Unmet

    versions = {name: None for name in PACKAGES} | {"torch": "2.10.0+cu128", "vllm": "0.20.0"}
    gpu = "NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.2 GiB)"
    env = InstalledSoftware(
        "3.12.3",
        versions,
        "12.8",
        "2.27.3",
        [gpu] * 8,
        "570.124.06",
        {"vllm": True, "lora": False},
        [Unmet("vllm", "0.20.0", "torch==2.9.0", "torch", "2.10.0+cu128")],
    )
    lines = check.environment_lines(env, "cuda")
    assert lines[:3] == [
        "environment",
        "  python        3.12.3",
        "  torch         2.10.0+cu128 (CUDA 12.8, NCCL 2.27.3)",
    ]
    assert "  vllm          0.20.0" in lines and "  peft          not installed" in lines
    assert f"  accelerator   GPU (GPUs: 8 x {gpu}; NVIDIA driver 570.124.06)" in lines
    assert "  extras        installed: vllm; not installed: lora" in lines
    assert (
        lines[-1]
        == "  conflict      vllm 0.20.0 requires torch==2.9.0 but torch 2.10.0+cu128 is installed"
    )


def test_the_dry_run_refuses_an_installed_vllm_outside_the_supported_range(
    tmp_path, monkeypatch, capsys
):
    """A vllm distribution (metadata only, nothing imports) on the path: the one-line refusal, exit
    2, and nothing on stdout (as for any bad input); the environment block shows it when the recipe
    does not use vLLM."""
    dist = tmp_path / "vllm-0.16.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.16.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        check.main([str(RECIPE), "rollout.engine=vllm"])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (
        'error: rollout.engine "vllm": vLLM 0.16.0 is installed but grpo_ds supports '
        f"vllm{VLLM_SPEC}. install a supported version: pip install 'vllm{VLLM_SPEC}'."
    )
    check.main([str(RECIPE)])  # the hf engine does not care which vLLM is installed
    out = capsys.readouterr().out
    assert (
        "recipe is valid for world size 1" in out and "  vllm          0.16.0" in out.splitlines()
    )


# ---------------------------------------------------------------------------------- split placement

SPLIT = 'rollout.placement="split"'


def test_a_layout_split_placement_cannot_run_is_one_line_and_exit_2(tmp_path):
    """The refusal comes from prepare_inputs (grpo_ds.config.placement), before anything is
    printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_ds.check", str(RECIPE), "--world-size", "1", SPLIT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        'error: rollout.placement: "split" needs at least 2 ranks (one trains, one generates); '
        "this launch has 1. launch with python -m grpo_ds.launch --num_gpus 2 or more, or use "
        '"colocated".'
    ]


def test_split_placement_counts_the_trainers_ranks(capsys):
    """3 launched ranks, the last one generating: the plan, DeepSpeed's batch size and the layout
    are those of 2 trainer ranks; the trainer's estimate holds no rollout copy and no generation
    phase, a rollout rank's line does."""
    check.main(
        [
            str(RECIPE),
            "--world-size",
            "3",
            SPLIT,
            "rollout.max_staleness=1",
            "algorithm.rollout_is_cap=2",
        ]
    )
    out = capsys.readouterr().out
    assert line_of(out, "placement:") == (
        "placement: split: ranks 0-1 train (ZeRO-3 over 2), rank 2 generates "
        "(1 rank), staleness at most 1"
    )
    assert (
        "parallel layout: trainer ranks 2 = data parallel "
        "2 x tensor parallel 1 x sequence parallel 1" in out
    )
    assert [rank[0] for rank in rank_lines(out)] == [0, 1]  # the rollout rank trains nothing
    assert sum(rank[1] for rank in rank_lines(out)) == 800
    assert re.search(r"train_batch_size\s+800 = 400 x 1 x trainer ranks 2$", out, re.M)
    assert "runs (importance weights" in line_of(out, "old-log-prob pass")
    assert line_of(out, "rollout:").startswith(
        "rollout: hf engine on the 1 rollout rank, with a plain copy"
    )
    trainer = out.split("memory estimate per trainer rank")[1].split("memory of a rollout rank")[0]
    assert (
        "rollout copy" not in trainer
        and "generation" not in trainer
        and "update micro-batch" in trainer
    )
    rollout = line_of(out, "memory of a rollout rank:")
    assert re.fullmatch(
        r"memory of a rollout rank: copy of the weights ([\d.]+) GiB \+ generation \(KV cache, "
        r"scores\) ([\d.]+) GiB = ([\d.]+) GiB",
        rollout,
    )


def test_the_rollout_copy_moves_from_the_trainer_to_the_rollout_rank():
    """Colocated, every rank holds the unsharded copy (ZeRO-3) and a generation phase; split, the
    trainer rank holds neither, and the rollout rank's copy is the same bytes, its generate call the
    whole step's prompts (1 rank)."""
    from grpo_ds.model import memory

    colocated = prepare_inputs(RECIPE, None, 2, "cpu")
    split = prepare_inputs(RECIPE, [SPLIT], 3, "cpu")
    # both train on 2 ranks
    assert split.ds_config["train_batch_size"] == colocated.ds_config["train_batch_size"]
    shape = memory.model_shape(colocated.recipe, len(colocated.tokenizer))
    lengths = check.simulated_lengths(colocated, "max")
    both = check.estimate_memory(
        colocated.recipe, shape, colocated.ds_config, 2, lengths, placement=colocated.placement
    )
    trainer = check.estimate_memory(
        split.recipe, shape, split.ds_config, 3, lengths, placement=split.placement
    )
    copy = both.device.pop("rollout copy (unsharded)")
    generation = both.phases.pop("generation (KV cache, scores)")
    # the rest: the same 2-rank trainer
    assert trainer.device == both.device and trainer.phases == both.phases
    r = split.recipe
    parts = memory.rollout_rank(
        r, shape, max(lengths), r.rollout.prompts_per_step * r.rollout.group_size
    )
    assert parts["copy of the weights"] == copy
    # all 25 prompts, not a rank's 13 of them
    assert parts["generation (KV cache, scores)"] * 13 == generation * 25
