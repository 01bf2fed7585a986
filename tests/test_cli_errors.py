"""The bad-input contract, through real processes: one line `error: <where>: <what>. <fix>` on
stderr, exit code 2, no traceback, nothing written (docs/operations/faults.md).

Each case runs `python -m grpo_ds.train` (or `grpo_ds.check`) in its own empty working directory
with run.output_dir pointing inside it, once per module. A fresh process pays ~8-10 s of CPU
importing torch and transformers, so all but REAL_PROCESSES run as forks of one process that has
imported them (tests/scripts/cli_forks.py: each fork a process of its own, with its own stdout,
stderr and exit code, running the module as `python -m` does); REAL_PROCESSES, one per command line,
start from nothing (what the libraries' imports print counts there too).
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.scripts.cli_forks import run_forked

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "tiny_cpu.json")

pytestmark = pytest.mark.slow


@dataclass
class Case:
    argv: list  # after `python -m`; {dir} is replaced by the case's working directory
    where: str  # the expected <where>; {dir} as above
    fragment: str  # part of <what>. <fix>
    files: dict | None = None  # name -> text, written into the working directory first


def _train(*overrides: str) -> list:
    return ["grpo_ds.train", RECIPE, "run.output_dir={dir}/out", *overrides]


# samples per step 800 = 25 x 32, micro 400, world size 1: gas 2, train_batch_size 800
CASES = {
    "unknown_key": Case(_train("train.lrr=1"), "train.lrr", "unknown key. did you mean 'lr'?"),
    "wrong_type": Case(
        _train("train.lr=fast"), "train.lr", 'expected a number, got a string "fast"'
    ),
    "out_of_range": Case(
        _train("rollout.top_p=1.5"), "rollout.top_p", "1.5 is out of range: must be <= 1.0"
    ),
    "samples_per_optimizer_step": Case(
        _train("train.samples_per_optimizer_step=7"),
        "train.samples_per_optimizer_step",
        "7 does not divide the samples per step 800",
    ),
    "deepspeed_train_batch_size": Case(
        _train("deepspeed={dir}/ds.json"),
        "{dir}/ds.json: train_batch_size",
        "is 7 but the recipe gives 800 (micro 400 x gradient accumulation 2 x world size 1). set "
        'train_batch_size to "auto" (grpo_ds derives it) or to 800.',
        files={"ds.json": json.dumps({"train_batch_size": 7, "zero_optimization": {"stage": 3}})},
    ),
    "model_path": Case(
        _train("model.path=/nonexistent"), "model.path", "/nonexistent does not exist"
    ),
    "data_file_missing": Case(
        _train("data.train={dir}/missing.jsonl"), "data.train", "{dir}/missing.jsonl not found"
    ),
    "data_row_without_prompt": Case(
        _train("data.train={dir}/rows.jsonl"),
        "data.train {dir}/rows.jsonl row 2",
        "no 'prompt' key (keys: ",
        files={
            "rows.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n'
        },
    ),
    "reward_not_importable": Case(
        _train('reward.functions=[{"name": "no_such_module_xyz:f"}]'),
        "reward.functions[0].name",
        "cannot import module 'no_such_module_xyz'",
    ),
    "check_bad_override": Case(
        ["grpo_ds.check", RECIPE, "--world-size", "2", "train.lrr=1"],
        "train.lrr",
        "did you mean 'lr'?",
    ),
    "recipe_missing": Case(
        ["grpo_ds.train", "{dir}/nope.json", "run.output_dir={dir}/out"],
        "{dir}/nope.json",
        "recipe file not found",
    ),
    "recipe_invalid_json": Case(
        ["grpo_ds.train", "{dir}/broken.json", "run.output_dir={dir}/out"],
        "{dir}/broken.json:2:",
        "invalid JSON",
        files={"broken.json": '{\n  "run": {"output_dir": "out",}\n}\n'},
    ),
    # issue 17's classes (tests/test_bad_inputs.py has each in detail)
    "non_finite_override": Case(_train("train.lr=NaN"), "train.lr", "NaN is not a finite number"),
    "non_finite_in_deepspeed_file": Case(
        _train("deepspeed={dir}/ds.json"),
        "{dir}/ds.json: gradient_clipping",
        "Infinity is not a finite number",
        files={"ds.json": '{"zero_optimization": {"stage": 3}, "gradient_clipping": Infinity}'},
    ),
    "deepspeed_offload_device": Case(
        _train("deepspeed={dir}/ds.json"),
        "{dir}/ds.json: zero_optimization.offload_optimizer.device",
        '"gpu" is rejected by DeepSpeed',
        files={
            "ds.json": json.dumps(
                {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}}
            )
        },
    ),
    "deepspeed_scheduler": Case(
        _train("deepspeed={dir}/ds.json"),
        "{dir}/ds.json: scheduler.type",
        '"CosineLR" is not a scheduler',
        files={
            "ds.json": json.dumps(
                {"zero_optimization": {"stage": 3}, "scheduler": {"type": "CosineLR"}}
            )
        },
    ),
    "output_dir_is_a_file": Case(
        _train("run.output_dir={dir}/afile"),
        "run.output_dir",
        "{dir}/afile exists and is not a folder",
        files={"afile": "not a folder"},
    ),
    "output_dir_below_a_file": Case(
        _train("run.output_dir={dir}/afile/runs"),
        "run.output_dir",
        "cannot be created: {dir}/afile is a file",
        files={"afile": "not a folder"},
    ),
    "run_name_outside_output_dir": Case(
        _train("run.name=../elsewhere"), "run.name", "is not a folder name inside run.output_dir"
    ),
    "data_file_without_rows": Case(
        _train("data.train={dir}/rows.jsonl"),
        "data.train {dir}/rows.jsonl",
        "has no rows",
        files={"rows.jsonl": ""},
    ),
    "eval_file_without_rows": Case(
        _train("eval.data={dir}/eval.json"),
        "eval.data {dir}/eval.json",
        "has no rows",
        files={"eval.json": "[]\n"},
    ),
    "longer_than_the_context": Case(
        _train("rollout.max_new_tokens=600"),
        "rollout.max_new_tokens",
        "604 is more than the model's context length 512",
    ),
    "check_longer_than_the_context": Case(
        ["grpo_ds.check", RECIPE, "rollout.max_new_tokens=600"],
        "rollout.max_new_tokens",
        "at most 508",
    ),
    "check_output_dir_is_a_file": Case(
        ["grpo_ds.check", RECIPE, "run.output_dir={dir}/afile"],
        "run.output_dir",
        "exists and is not a folder",
        files={"afile": "not a folder"},
    ),
}


@dataclass
class Result:
    returncode: int
    stderr: str
    stdout: str
    workdir: Path
    files_before: set
    files_after: set


def _env() -> dict:
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a plain single process, as a user would start it
    return env


# these cases run as plain `python -m` processes, the others as forks of a preloaded one
REAL_PROCESSES = ("unknown_key", "check_bad_override")


def _prepare(workdir: Path, case: Case) -> tuple[list[str], set]:
    """The case's working directory with its files; its argv (after `python -m`) and the files there
    before."""
    workdir.mkdir()
    for name, text in (case.files or {}).items():
        (workdir / name).write_text(text)
    return [a.replace("{dir}", str(workdir)) for a in case.argv], {
        p.relative_to(workdir) for p in workdir.rglob("*")
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Result]:
    base = tmp_path_factory.mktemp("cli_errors")
    prepared = {name: _prepare(base / name, case) for name, case in CASES.items()}
    forked = [name for name in CASES if name not in REAL_PROCESSES]
    finished = dict(
        zip(
            forked,
            run_forked(
                [(prepared[name][0], base / name) for name in forked], _env(), base / "_forks"
            ),
            strict=True,
        )
    )
    for name in REAL_PROCESSES:
        finished[name] = subprocess.run(
            [sys.executable, "-m", *prepared[name][0]],
            cwd=base / name,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
    return {
        name: Result(
            finished[name].returncode,
            finished[name].stderr,
            finished[name].stdout,
            base / name,
            prepared[name][1],
            {p.relative_to(base / name) for p in (base / name).rglob("*")},
        )
        for name in CASES
    }


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_error_line(results, name):
    case, result = CASES[name], results[name]
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1, result.stderr
    where = case.where.replace("{dir}", str(result.workdir))
    assert errors[0].startswith(f"error: {where}"), errors[0]
    assert case.fragment.replace("{dir}", str(result.workdir)) in errors[0]
    assert errors[0].endswith((".", "?")), errors[0]  # the fix sentence is complete


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_writes_nothing(results, name):
    result = results[name]
    assert not (result.workdir / "out").exists()
    # not even a default runs/ folder in the working directory
    assert result.files_after == result.files_before
    assert result.stdout == ""
