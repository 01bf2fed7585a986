"""Bad input by class (issue 17), each refused with one UserError before any model loads or any file
is written: non-finite numbers, DeepSpeed values DeepSpeed would reject only when it builds the
engine, output paths that are not writable folders, data and eval files with no rows, and prompt +
completion longer than the model's context. The command-line side (one line, exit 2, nothing
written) is in tests/test_cli_errors.py."""

import json
import math
import os
from pathlib import Path

import pytest

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.deepspeed_check import check_precision_supported
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.recipe import DataConfig, ModelConfig, iter_fields
from grpo_ds.errors import UserError
from grpo_ds.model.loading import context_length
from grpo_ds.run import folder as run_folder
from grpo_ds.run.preflight import prepare_inputs
from grpo_ds.run.prompts import load_rows

REPO = Path(__file__).resolve().parents[1]
ZERO3 = json.loads((REPO / "ds_configs" / "zero3.json").read_text())


def error_of(fn, *args, **kwargs) -> UserError:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return info.value


def inputs_error(tmp_path, overrides=(), **sections) -> UserError:
    """prepare_inputs (the dry run's and the trainer's validation) on the tiny recipe, output inside
    tmp_path; the working directory must stay as it was."""
    raw = {"run": {"output_dir": str(tmp_path / "out")}, "rollout": {"max_new_tokens": 2}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    before = sorted(tmp_path.rglob("*"))
    err = error_of(prepare_inputs, raw, list(overrides), 1, "cpu")
    assert sorted(tmp_path.rglob("*")) == before  # nothing written
    return err


# ------------------------------------------------------------------------------- non-finite numbers

FLOAT_KEYS = [
    f"{s}.{f.name}"
    for s, f in iter_fields()
    if s and "float" in str(f.type) and "list" not in str(f.type)
]


def test_every_float_key_is_covered():
    assert {"train.lr", "rollout.temperature", "algorithm.kl_coef", "eval.correct_at"} <= set(
        FLOAT_KEYS
    )


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_override_is_refused(key, text):
    err = error_of(load_recipe, {}, [f"{key}={text}"])
    assert err.where == key and "is not a finite number" in err.what


def test_non_finite_in_a_recipe_file_and_inside_lists_and_objects(tmp_path):
    path = tmp_path / "r.json"
    # Python's json (and others) accept the JSON extension
    path.write_text('{"train": {"lr": NaN}}')
    assert error_of(load_recipe, path).where == "train.lr"
    assert (
        error_of(load_recipe, {"train": {"adam_betas": [0.9, math.inf]}}).where
        == "train.adam_betas[1]"
    )
    err = error_of(
        load_recipe,
        {
            "rollout": {
                "engine": "agent",
                "env": "calculator",
                "env_options": {"limits": {"max": -math.inf}},
            }
        },
    )
    assert err.where == "rollout.env_options.limits.max" and "-Infinity" in err.what
    err = error_of(
        load_recipe, {"reward": {"functions": [{"name": "exact_match", "weight": math.nan}]}}
    )
    assert err.where == "reward.functions[0].weight"


def test_non_finite_in_deepspeed_inline_and_file(tmp_path):
    err = error_of(
        load_recipe,
        {"deepspeed": {"zero_optimization": {"stage": 3, "reduce_bucket_size": math.inf}}},
    )
    assert err.where == "deepspeed.zero_optimization.reduce_bucket_size"
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": NaN}')
    err = error_of(resolve_deepspeed_config, load_recipe({"deepspeed": str(ds)}), 1, "cpu")
    assert err.where == f"{ds}: gradient_clipping" and "NaN" in err.what


# --------------------------------------------------------------------------------- DeepSpeed config


def ds_error(mutate: dict, model_dtype="float32", **sections) -> UserError:
    raw = json.loads(json.dumps(ZERO3))
    for dotted, value in mutate.items():
        node = raw
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    recipe = load_recipe({"deepspeed": raw, "model": {"dtype": model_dtype}, **sections})
    return error_of(resolve_deepspeed_config, recipe, 2, "cpu")


@pytest.mark.parametrize(
    "mutate, where, fragment",
    [
        ({"zero_optimization.stage": 4}, "zero_optimization.stage", "4 is not a ZeRO stage"),
        ({"zero_optimization.stage": "3"}, "zero_optimization.stage", '"3" is not a ZeRO stage'),
        (
            {"zero_optimization.offload_optimizer": {"device": "gpu"}},
            "zero_optimization.offload_optimizer.device",
            "'none', 'cpu' or 'nvme'",
        ),  # DeepSpeed's own pydantic enum
        (
            {"zero_optimization.offload_param": {"device": "nvme"}},
            "zero_optimization.offload_param.nvme_path",
            'is needed with device "nvme"',
        ),
        (
            {"zero_optimization.stage3_prefetch_bucket": 1},
            "zero_optimization.stage3_prefetch_bucket",
            "is not a key DeepSpeed knows. did you mean 'stage3_prefetch_bucket_size'?",
        ),
        (
            {"zero_optimization.reduce_bucket_size": "big"},
            "zero_optimization.reduce_bucket_size",
            "valid integer",
        ),
        ({"zero_optimization": 3}, "zero_optimization", "must be a JSON object"),
        ({"bf16.master_weights": True}, "bf16.master_weights", "is not a key DeepSpeed knows"),
        ({"fp16.loss_scale": "dynamic"}, "fp16.loss_scale", "fp16.loss_scale must be a number"),
        ({"gradient_allreduce_op": "sum"}, "", "not supported with ZeRO stage 3"),
        ({"optimizer": "adamw"}, "optimizer", "must be a JSON object"),
        (
            {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm",
            "train.max_grad_norm sets gradient_clipping",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}},
            "optimizer.params.betas",
            "list of two numbers",
        ),
        ({"scheduler": {"type": "WarmupLr"}}, "scheduler.type", "did you mean 'WarmupLR'?"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
            "scheduler.params.warmup_num_step",
            "did you mean 'warmup_num_steps'?",
        ),
        ({"scheduler": {"type": "WarmupDecayLR"}}, "scheduler.params", "'total_num_steps'"),
        ({"data_types.param_dtype": "bf16"}, "data_types.param_dtype", 'model.dtype is "float32"'),
    ],
)
def test_deepspeed_values_deepspeed_would_reject(mutate, where, fragment):
    err = ds_error(mutate)
    assert err.where == "deepspeed" + (f": {where}" if where else "")
    assert fragment in str(err)


def test_bf16_and_fp16_follow_model_dtype():
    err = ds_error({"fp16.enabled": True}, model_dtype="bfloat16")
    assert err.where == "deepspeed: fp16.enabled" and "model.dtype 'bfloat16'" in err.what


def test_warm_up_keys_go_only_to_schedulers_that_take_them():
    """WarmupCosineLR has no warmup_max_lr (grpo_ds used to fill it, and DeepSpeed's constructor
    failed)."""
    recipe = load_recipe(
        {
            "train": {"warmup_steps": 3},
            "deepspeed": {
                **ZERO3,
                "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}},
            },
        }
    )
    params = resolve_deepspeed_config(recipe, 1, "cpu")["scheduler"]["params"]
    assert params == {"total_num_steps": 100, "warmup_num_steps": 3, "warmup_type": "linear"}
    err = ds_error(
        {"scheduler": {"type": "StepLR", "params": {"step_size": 10}}}, train={"warmup_steps": 3}
    )
    assert err.where == "train.warmup_steps" and "StepLR" in err.what
    recipe = load_recipe(
        {"deepspeed": {**ZERO3, "scheduler": {"type": "StepLR", "params": {"step_size": 10}}}}
    )
    assert resolve_deepspeed_config(recipe, 1, "cpu")["scheduler"]["params"] == {"step_size": 10}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "ds_configs").glob("*.json")))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shipped_deepspeed_files_pass(name, dtype):
    recipe = load_recipe(
        {"deepspeed": f"ds_configs/{name}", "model": {"dtype": dtype}, "train": {"warmup_steps": 2}}
    )
    assert resolve_deepspeed_config(recipe, 2, "cpu")["zero_optimization"]["stage"] == 3


def test_precision_the_accelerator_lacks():
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this accelerator supports fp16")
    err = error_of(check_precision_supported, {"fp16": {"enabled": True}}, "cpu")
    assert err.where == "model.dtype" and '"float16" is not supported' in err.what
    check_precision_supported({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, "cpu")


# ------------------------------------------------------------------------------------- output paths


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    err = error_of(run_folder.check_run_folder, str(tmp_path / "file"), "run")
    assert err.where == "run.output_dir" and "exists and is not a folder" in err.what
    err = error_of(run_folder.check_run_folder, str(tmp_path / "file" / "deeper"), "run")
    assert (
        err.where == "run.output_dir"
        and f"cannot be created: {tmp_path / 'file'} is a file" in err.what
    )
    err = error_of(run_folder.check_run_folder, str(tmp_path), "file")
    assert err.where == "run.name" and "exists and is not a folder" in err.what


@pytest.mark.parametrize("name", ["", " ", ".", "./.", "..", "a/../..", "/etc"])
def test_run_name_must_stay_inside_output_dir(tmp_path, name):
    err = error_of(run_folder.check_run_folder, str(tmp_path), name)
    assert err.where == "run.name" and "not a folder name inside run.output_dir" in err.what


def test_creatable_and_existing_folders_pass(tmp_path):
    assert (
        run_folder.check_run_folder(str(tmp_path / "a" / "b"), "run")
        == tmp_path / "a" / "b" / "run"
    )
    assert not (tmp_path / "a").exists()  # checked, not created
    run_folder.check_run_folder(str(tmp_path), "group/run")


def test_folder_that_is_not_writable(tmp_path, monkeypatch):
    """Permissions through os.access (as root, chmod would not stop the write): the nearest existing
    folder counts."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(
        run_folder.os, "access", lambda p, mode: Path(p) != locked and real(p, mode)
    )
    err = error_of(run_folder.check_output_folder, locked / "runs" / "x", "run.output_dir")
    assert f"cannot be created: {locked} is not writable" in err.what
    err = error_of(run_folder.check_output_folder, locked, "run.output_dir")
    assert err.what == f"{locked} is not writable"


def test_line_breaks_in_a_path_stay_on_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    err = error_of(run_folder.check_output_folder, str(tmp_path / "f" / "a\nb"), "run.output_dir")
    assert "a\\nb" in err.what and "is a file" in err.what


def test_prepare_inputs_checks_the_run_folder_first(tmp_path):
    (tmp_path / "out").write_text("not a folder")
    err = inputs_error(tmp_path)
    assert err.where == "run.output_dir" and "exists and is not a folder" in err.what


# --------------------------------------------------------------------------------------- empty data


@pytest.mark.parametrize(
    "name, text",
    [
        ("rows.jsonl", ""),
        ("rows.jsonl", "\n  \n"),
        ("rows.json", ""),
        ("rows.json", "[ ]\n"),
        ("rows.json", "{}"),
    ],
)
def test_data_file_without_rows(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    err = error_of(load_rows, DataConfig(train=str(tmp_path / name)))
    assert err.where == f"data.train {tmp_path / name}" and err.what.startswith("has no rows")
    assert "StopIteration" not in str(err)


def test_parquet_and_saved_dataset_without_rows(tmp_path):
    import datasets

    empty = datasets.Dataset.from_dict({"prompt": [], "answer": []})
    empty.to_parquet(str(tmp_path / "rows.parquet"))
    err = error_of(load_rows, DataConfig(train=str(tmp_path / "rows.parquet")))
    assert err.what.startswith("has no rows")
    empty.save_to_disk(str(tmp_path / "saved"))
    err = inputs_error(tmp_path, data={"train": str(tmp_path / "saved")})
    assert err.where == f"data.train {tmp_path / 'saved'}" and err.what.startswith("has no rows")
    datasets.DatasetDict({"train": empty}).save_to_disk(str(tmp_path / "saved_dict"))
    err = inputs_error(tmp_path, eval={"data": str(tmp_path / "saved_dict")})
    assert err.where == f"eval.data {tmp_path / 'saved_dict'}" and err.what.startswith(
        "has no rows"
    )


def test_eval_file_without_rows(tmp_path):
    (tmp_path / "eval.jsonl").write_text("")
    err = inputs_error(tmp_path, eval={"data": str(tmp_path / "eval.jsonl")})
    assert err.where == f"eval.data {tmp_path / 'eval.jsonl'}" and err.what.startswith(
        "has no rows"
    )


def test_eval_file_whose_rows_are_all_bad(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"question": "1+1="}\n')
    err = inputs_error(
        tmp_path, eval={"data": str(tmp_path / "eval.jsonl")}, data={"on_bad_row": "skip"}
    )
    assert (
        err.where == f"eval.data {tmp_path / 'eval.jsonl'}"
        and "all 1 rows are bad (1 missing)" in err.what
    )


# ----------------------------------------------------------------------------------- context length


def test_builtin_context_length_against_the_longest_prompt(tmp_path):
    assert context_length(ModelConfig()) == (512, "max_position_embeddings of builtin:tiny")
    # arith prompts are 4 tokens: 604 > 512
    err = inputs_error(tmp_path, rollout={"max_new_tokens": 600})
    assert err.where == "rollout.max_new_tokens"
    assert (
        "604 is more than the model's context length 512" in err.what and "at most 508" in err.fix
    )
    prepare_inputs(
        {"run": {"output_dir": str(tmp_path / "ok")}, "rollout": {"max_new_tokens": 508}},
        None,
        1,
        "cpu",
    )


def test_agent_budget_and_eval_prompts_count(tmp_path):
    err = inputs_error(
        tmp_path, rollout={"engine": "agent", "env": "calculator", "max_total_tokens": 600}
    )
    assert err.where == "rollout.max_total_tokens"
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "x" * 500, "answer": "1"}) + "\n")
    err = inputs_error(
        tmp_path, eval={"data": str(tmp_path / "eval.jsonl")}, rollout={"max_new_tokens": 20}
    )
    assert "500 tokens, eval.data row 1" in err.what and "at most 12" in err.fix


def test_vllm_plans_its_budget_against_the_context(tmp_path):
    """vLLM refuses a max_model_len past the model's (it plans its KV cache for the budget, not the
    prompts seen)."""
    raw = {
        "run": {"output_dir": str(tmp_path / "out")},
        "rollout": {"engine": "vllm", "max_new_tokens": 2},
    }
    err = error_of(
        prepare_inputs, raw, ["rollout.vllm_max_model_len=1000"], 1, "cpu", machine=False
    )
    assert (
        err.where == "rollout.vllm_max_model_len"
        and "1000 is more than the model's context length 512" in err.what
    )
    err = error_of(prepare_inputs, raw, ["data.max_prompt_tokens=511"], 1, "cpu", machine=False)
    assert err.where == "data.max_prompt_tokens + rollout.max_new_tokens" and err.what.startswith(
        "513 is more"
    )
    prepare_inputs(raw, ["data.max_prompt_tokens=510"], 1, "cpu", machine=False)


def write_config(folder: Path, **config) -> ModelConfig:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return ModelConfig(path=str(folder))


def test_context_length_from_a_model_folder(tmp_path):
    folder = tmp_path / "m"
    assert context_length(write_config(folder, max_position_embeddings=4096))[0] == 4096
    # the smallest
    assert context_length(write_config(folder, n_positions=1024, n_ctx=2048))[0] == 1024
    assert (
        context_length(write_config(folder, text_config={"max_position_embeddings": 8192}))[0]
        == 8192
    )
    length, source = context_length(
        write_config(
            folder,
            max_position_embeddings=32768,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        )
    )
    assert length == 131072 and "yarn" in source and str(folder / "config.json") in source
    # llama3's window is already the extended one
    assert (
        context_length(
            write_config(
                folder,
                max_position_embeddings=8192,
                rope_scaling={"rope_type": "llama3", "factor": 8.0},
            )
        )[0]
        == 8192
    )
    assert context_length(write_config(folder)) is None
    (folder / "config.json").write_bytes(b"\xff\xfe{}")
    assert "is not UTF-8" in error_of(context_length, ModelConfig(path=str(folder))).what


# ------------------------------------------------------------------------------------- recipe files


def test_unreadable_recipe_files(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"train": {"lr": 0.1}}', encoding="utf-16")
    assert "is not UTF-8" in error_of(load_recipe, path).what
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in error_of(load_recipe, path).what


def test_recipe_path_that_is_a_folder_or_has_a_line_break(tmp_path):
    assert error_of(load_recipe, tmp_path).what == "is a folder, not a recipe file"
    assert error_of(load_recipe, str(tmp_path / "a\nb.json")).where == json.dumps(
        str(tmp_path / "a\nb.json")
    )


def test_huge_samples_per_step_is_answered_at_once():
    err = error_of(
        load_recipe,
        {
            "rollout": {"prompts_per_step": 10**12, "group_size": 16},
            "train": {"samples_per_optimizer_step": 7},
        },
    )
    assert "use a divisor such as 4, 5, 8" in err.fix


def test_export_out_folder_below_a_file(tmp_path):
    """The exporter's --out gets the same check, before any model is built (mkdir raised
    FileExistsError after)."""
    from grpo_ds.export import _check_out_dir

    (tmp_path / "file").write_text("x")
    err = error_of(_check_out_dir, tmp_path / "file" / "model", tmp_path / "run", False)
    assert err.where == "--out" and f"cannot be created: {tmp_path / 'file'} is a file" in err.what
    assert (
        _check_out_dir(tmp_path / "new" / "model", tmp_path / "run", False)
        == tmp_path / "new" / "model"
    )
