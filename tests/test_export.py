"""grpo_ds.export: ZeRO-3 checkpoints of any world size become folders transformers loads on its
own, with the trained engine's logits; damaged checkpoints are named; user mistakes are one-line
errors with exit code 2.

The slow tests share two `deepspeed` launches (tests/scripts/export_make_ckpt.py): world size 1
makes a builtin:tiny run, world size 2 a builtin:tiny run and a run on a local HF folder with tied
embeddings; each run holds checkpoints of steps 1 and 2 and the engine's own parameters and logits
at both steps. The fast tests build fake run folders and need no DeepSpeed.
"""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo_ds.errors import UserError
from grpo_ds.export import (
    export,
    export_checkpoint,
    list_checkpoints,
    main,
    select_checkpoint,
    verify_checkpoint,
)
from tests.launch import REPO, clean_env, deepspeed_launch
from tests.scripts.cli_forks import run_forked
from tests.scripts.export_make_ckpt import HF_GENERATION, TEXTS

SCRIPT = str(REPO / "tests" / "scripts" / "export_make_ckpt.py")
# fp32 logits: the exported weights are bit-identical to the engine's (checked with torch.equal), so
# logits can differ only by the summation order of CPU matmul kernels, which depends on the thread
# count (each rank runs with 1 thread, the test process with 2): a few fp32 ulps of the O(1) logits
# (~1e-6). 1e-5 leaves room for that and is 4 orders of magnitude below the change one optimizer
# step makes (asserted > 0.1 below).
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(world_size) -> folder with the run folders that world size's launch wrote (one launch
    each, cached)."""
    cache = {}

    def get(world_size: int) -> Path:
        if world_size not in cache:
            root = tmp_path_factory.mktemp(f"export_w{world_size}")
            kinds = "tiny" if world_size == 1 else "tiny,hf_tied"
            deepspeed_launch(world_size, [SCRIPT, str(root), kinds])
            cache[world_size] = root
        return cache[world_size]

    return get


def _load_exported(folder: Path):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return tokenizer, model


def _logits(tokenizer, model, expected: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The exported model's logits on the script's texts (tokenized by the exported tokenizer), and
    the mask."""
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    # the tokenizer round-trips, left padding too
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert torch.equal(batch["attention_mask"], expected["attention_mask"])
    with torch.no_grad():
        logits = model(**batch).logits.float()  # (B, T, V)
    return logits, batch["attention_mask"].bool()


# ----------------------------------------------------------------------------------- with DeepSpeed


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_exported_model_loads_with_transformers_and_gives_the_engines_logits(
    made, world_size, tmp_path
):
    run = made(world_size) / "tiny"
    expected = torch.load(run / "expected_logits.pt")
    for step in (2, 1):  # the latest by default, then an older one by --step
        out = export_checkpoint(run, tmp_path / f"step{step}", step=None if step == 2 else 1)
        assert sorted(p.name for p in out.iterdir()) == [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        tokenizer, model = _load_exported(out)
        assert model.dtype == torch.float32 and tokenizer.padding_side == "left"
        params = model.state_dict()
        for name, tensor in expected["steps"][step]["params"].items():
            assert torch.equal(params[name], tensor), name
        logits, mask = _logits(tokenizer, model, expected)
        torch.testing.assert_close(
            logits[mask], expected["steps"][step]["logits"][mask], **FP32_TOL
        )
        generation = GenerationConfig.from_pretrained(out)
        assert (generation.eos_token_id, generation.pad_token_id) == (
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
    # the comparisons can fail: one optimizer step moves the logits by far more than the tolerances
    moved = (expected["steps"][2]["logits"] - expected["steps"][1]["logits"])[mask].abs().max()
    assert moved > 0.1


@pytest.mark.slow
def test_local_hf_folder_with_tied_embeddings(made, tmp_path):
    run = made(2) / "hf_tied"
    expected = torch.load(run / "expected_logits.pt")
    out = export_checkpoint(run, tmp_path / "model")
    tokenizer, model = _load_exported(out)
    assert (
        model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    )
    for name, tensor in expected["steps"][2]["params"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
    logits, mask = _logits(tokenizer, model, expected)
    torch.testing.assert_close(logits[mask], expected["steps"][2]["logits"][mask], **FP32_TOL)
    # the model folder's own generation config, carried over
    generation = GenerationConfig.from_pretrained(out)
    assert {key: getattr(generation, key) for key in HF_GENERATION} == HF_GENERATION


@pytest.mark.slow
def test_bfloat16_export_is_the_fp32_weights_rounded(made, tmp_path):
    run = made(1) / "tiny"
    expected = torch.load(run / "expected_logits.pt")
    summary = export(run, tmp_path / "bf16", dtype="bfloat16")
    assert summary.dtype == "bfloat16" and summary.step == 2 and summary.num_parameters == 39_520
    tokenizer, model = _load_exported(summary.out_dir)
    assert model.dtype == torch.bfloat16
    for name, tensor in expected["steps"][2]["params"].items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16)), name
    logits, mask = _logits(tokenizer, model, expected)
    # bf16 rounds every weight and activation to 8 significant bits (relative error up to 2^-8 ~
    # 4e-3); the logits here are below 1 in size, and two layers of such rounding move them by ~5e-3
    # (measured 4.6e-3 max). 0.02 allows for that and stays far below what one optimizer step
    # changes (> 0.1, asserted in the fp32 test)
    torch.testing.assert_close(
        logits[mask], expected["steps"][2]["logits"][mask], rtol=0.0, atol=0.02
    )


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip_byte"])
def test_damaged_checkpoint_is_named_and_an_older_step_still_exports(
    made, tmp_path, damage, capsys
):
    run = tmp_path / "run"
    shutil.copytree(made(2) / "tiny", run)
    shard = (
        run / "checkpoints" / "step_00000002" / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(data)

    with pytest.raises(UserError) as err:
        export_checkpoint(run, tmp_path / "out")
    message = str(err.value)
    assert (
        "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt does not match its sha256 in manifest.json"
        in message
    )
    assert "--step" in message and "steps before it: 1" in message
    assert not (tmp_path / "out").exists()

    assert export_checkpoint(run, tmp_path / "out", step=1).is_dir()

    with pytest.raises(SystemExit) as code:
        main([str(run), "--out", str(tmp_path / "out2")])
    assert code.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and "optim_states.pt" in stderr

    main([str(run), "--list"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["step", "1", "ok"]
    assert lines[2].split()[:5] == ["step", "2", "DAMAGED", "step_00000002", "(latest):"]
    assert lines[2].endswith(
        "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt does not match its sha256 in manifest.json "
        "(damaged or changed after saving)"
    )


@pytest.mark.slow
def test_command_line_summary_and_overwrite(made, tmp_path):
    run = made(1) / "tiny"
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("x")
    cmd = ["grpo_ds.export", str(run), "--out", str(out), "--step", "1"]
    # one after the other, each a process of its own forked from one that imported the libraries
    # (cli_forks.py)
    refused, done = run_forked(
        [(cmd, REPO), ([*cmd, "--overwrite"], REPO)],
        clean_env(),
        tmp_path / "forks",
        timeout=300,
        parallel=1,
    )
    assert refused.returncode == 2 and refused.stdout == ""
    assert (
        refused.stderr
        == f"error: --out: {out} exists and is not empty. give a new folder, or pass --overwrite.\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [
        f"checkpoint: {run}/checkpoints/step_00000001 (step 1, verified against manifest.json)",
        "model:      LlamaForCausalLM, 39,520 parameters, float32",
    ]
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------- fake run folders, no DeepSpeed


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _fake_run(root: Path, steps=(1, 2), latest: str | None = "step_00000002") -> Path:
    """A run folder whose checkpoints hold a manifest-verified fake shard each (enough to pick and
    verify: real PyTorch files, as verify checks their structure, of placeholder contents)."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.json").write_text(json.dumps({"model": {"path": "builtin:tiny"}}))
    for step in steps:
        folder = run / "checkpoints" / f"step_{step:08d}"
        (folder / "ds").mkdir(parents=True)
        files = {
            "ds/zero_pp_rank_0_mp_rank_00_model_states.pt": _torch_bytes({"module": "fake"}),
            "trainer_state.json": b"{}",
            "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt": _torch_bytes({"optimizer": "fake"}),
        }
        for name, data in files.items():
            (folder / name).write_bytes(data)
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        (folder / "manifest.json").write_text(json.dumps({"step": step, "files": digests}))
    if latest:
        (run / "checkpoints" / "latest").write_text(latest + "\n")
    return run


def test_checkpoint_selection(tmp_path):
    run = _fake_run(tmp_path, steps=(5, 10, 20), latest="step_00000010")
    (run / "checkpoints" / ".tmp-step_00000030").mkdir()  # an unfinished write: never a candidate
    assert select_checkpoint(run).step == 10  # latest wins over the highest step
    assert select_checkpoint(run, step=5).step == 5
    (run / "checkpoints" / "latest").unlink()
    assert select_checkpoint(run).step == 20  # no latest: the highest step
    assert [c.step for c in list_checkpoints(run)] == [5, 10, 20]
    assert all(c.problem is None for c in list_checkpoints(run))


def test_verify_names_the_bad_file(tmp_path):
    run = _fake_run(tmp_path)
    folder = run / "checkpoints" / "step_00000001"
    assert verify_checkpoint(folder) is None
    (folder / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"stray")
    assert verify_checkpoint(folder).startswith(
        "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt is not listed"
    )
    (folder / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (folder / "trainer_state.json").unlink()
    assert verify_checkpoint(folder) == "trainer_state.json is missing"
    (folder / "manifest.json").unlink()
    assert verify_checkpoint(folder).startswith("manifest.json is missing")


def test_tied_weight_absent_from_the_state_dict_is_filled_from_its_twin():
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_ds.model.rebuild import load_strict

    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    source, target = LlamaForCausalLM(config), LlamaForCausalLM(config)
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    load_strict(target, state, Path("ckpt"))
    assert torch.equal(target.lm_head.weight, source.model.embed_tokens.weight)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    del state["model.norm.weight"]
    with pytest.raises(
        UserError, match=r"do not fit the model in recipe.json: missing model.norm.weight \(1\)"
    ):
        load_strict(target, state, Path("ckpt"))


def _cli_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as code:
        main(argv)
    assert code.value.code == 2
    captured = capsys.readouterr()
    assert (
        captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1
    )
    return captured.err


def test_user_mistakes_are_one_line_errors(tmp_path, capsys):
    run = _fake_run(tmp_path)
    out = str(tmp_path / "out")
    assert "no such run folder" in _cli_error([str(tmp_path / "nope"), "--out", out], capsys)
    (tmp_path / "empty").mkdir()
    assert "no recipe.json in it" in _cli_error([str(tmp_path / "empty"), "--out", out], capsys)
    assert _cli_error([str(run), "--out", out, "--step", "7"], capsys) == (
        f"error: --step: no checkpoint of step 7 in {run}/checkpoints. available steps: 1, 2.\n"
    )
    assert "--out is required" in _cli_error([str(run)], capsys)
    assert "argument --dtype: invalid choice" in _cli_error(
        [str(run), "--out", out, "--dtype", "fp8"], capsys
    )
    assert "argument --step: invalid int value" in _cli_error(
        [str(run), "--out", out, "--step", "x"], capsys
    )
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    assert "is not empty" in _cli_error([str(run), "--out", str(tmp_path / "busy")], capsys)
    assert "which --overwrite would delete" in _cli_error(
        [str(run), "--out", str(tmp_path), "--overwrite"], capsys
    )
    (run / "checkpoints" / "latest").write_text("step_00000099")
    assert "names 'step_00000099'" in _cli_error([str(run), "--out", out], capsys)
    (run / "checkpoints" / "latest").unlink()
    (run / "recipe.json").write_text(json.dumps({"model": {"path": str(tmp_path / "gone")}}))
    assert f"recipe.json: model.path: {tmp_path / 'gone'} does not exist" in _cli_error(
        [str(run), "--out", out], capsys
    )
    shutil.rmtree(run / "checkpoints")
    assert "no checkpoints in this run folder" in _cli_error([str(run), "--list"], capsys)
    assert not (tmp_path / "out").exists()


def test_errors_through_a_real_process(tmp_path):
    """The contract as a user meets it: exit code 2, one line on stderr, no traceback."""
    env = {**clean_env(), "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_ds.export", str(tmp_path / "nope"), "--out", "x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.startswith(f"error: {tmp_path / 'nope'}: no such run folder.")
        and proc.stderr.count("\n") == 1
    )
