"""Loading the policy: builtin:tiny, local HF folders (saved here, never downloaded), path errors,
weights that are missing, cut short or garbage, and the tokenizer class a folder saved, whatever its
model type."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config

from grpo_ds.config.recipe import ModelConfig
from grpo_ds.errors import UserError
from grpo_ds.model.loading import (
    check_model_path,
    check_weights,
    load_model,
    load_tokenizer,
    torch_dtype,
)
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.run.preflight import prepare_inputs

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.json"


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory):
    """A builtin tiny model and its tokenizer saved as an ordinary HF model folder."""
    folder = tmp_path_factory.mktemp("tiny_hf")
    tok = build_tiny_tokenizer()
    build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, seed=5).save_pretrained(
        folder
    )
    tok.save_pretrained(folder)
    return folder


def test_torch_dtype():
    assert torch_dtype("float32") is torch.float32
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float16") is torch.float16
    with pytest.raises(UserError) as err:
        torch_dtype("fp8")
    assert err.value.where == "model.dtype"


def test_builtin_tokenizer_and_model():
    cfg = ModelConfig(path="builtin:tiny", tiny_hidden_size=16, tiny_num_layers=1, tiny_num_heads=2)
    check_model_path(cfg)
    tok = load_tokenizer(cfg)
    assert tok.pad_token_id == 0 and tok.padding_side == "left"
    model = load_model(cfg, vocab_size=len(tok), seed=0)
    assert model.config.hidden_size == 16 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok)
    again = load_model(cfg, vocab_size=len(tok), seed=0)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)


def test_builtin_dtype_and_gradient_checkpointing():
    cfg = ModelConfig(
        dtype="bfloat16",
        gradient_checkpointing=True,
        tiny_hidden_size=16,
        tiny_num_layers=1,
        tiny_num_heads=2,
    )
    model = load_model(cfg, vocab_size=40, seed=0)
    assert model.dtype == torch.bfloat16
    assert model.config.use_cache is False
    assert model.model.gradient_checkpointing is True
    model.train()
    out = model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]]))
    out.loss.backward()  # checkpointed backward works
    assert model.lm_head.weight.grad is not None


def test_missing_folder(tmp_path):
    cfg = ModelConfig(path=str(tmp_path / "nope"))
    for fn in (check_model_path, load_tokenizer):
        with pytest.raises(UserError) as err:
            fn(cfg)
        assert err.value.where == "model.path"
        assert err.value.what == f"{tmp_path / 'nope'} does not exist"
        assert "builtin:tiny" in err.value.fix


def test_folder_without_config(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = ModelConfig(path=str(tmp_path))
    for fn in (check_model_path, load_tokenizer, lambda c: load_model(c, 10, 0)):
        with pytest.raises(UserError) as err:
            fn(cfg)
        assert err.value.where == "model.path"
        assert (
            "not a Hugging Face model folder" in err.value.what and "config.json" in err.value.what
        )


def test_unknown_builtin_model():
    with pytest.raises(UserError) as err:
        check_model_path(ModelConfig(path="builtin:huge"))
    assert "builtin:huge" in err.value.what and "builtin:tiny" in err.value.fix


def test_folder_without_tokenizer_files(tmp_path):
    # transformers 5 would silently build an empty 1-token tokenizer here; we refuse instead.
    (tmp_path / "config.json").write_text(
        json.dumps(build_tiny_model(20, hidden_size=16, num_heads=2).config.to_dict())
    )
    with pytest.raises(UserError) as err:
        load_tokenizer(ModelConfig(path=str(tmp_path)))
    assert "no tokenizer files" in err.value.what


def test_folder_without_weights(tmp_path, saved_folder):
    (tmp_path / "config.json").write_text((saved_folder / "config.json").read_text())
    for fn in (check_weights, lambda c: load_model(c, 10, 0)):
        with pytest.raises(UserError) as err:
            fn(ModelConfig(path=str(tmp_path)))
        assert err.value.where == "model.path"
        assert err.value.what.startswith(f"{tmp_path} holds no weights (none of model.safetensors")


def _damaged_copy(saved_folder, tmp_path, damage) -> Path:
    folder = Path(shutil.copytree(saved_folder, tmp_path / "damaged"))
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 99)
    return weights


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_weights_are_refused_before_anything_loads(tmp_path, saved_folder, damage):
    """The failed copy of issue 51: model.safetensors cut to half, or bytes of another file. The
    pre-load check (prepare_inputs, through check_weights) names the file; so does load_model when
    the file is damaged after that check, instead of safetensors' SafetensorError."""
    weights = _damaged_copy(saved_folder, tmp_path, damage)
    problem = {
        "truncated": f"{weights} is cut short: {weights.stat().st_size:,} of its",
        "garbage": f"{weights} is not a safetensors file (its first 8 bytes give a header length",
    }[damage]
    out = tmp_path / "out"
    with pytest.raises(UserError) as err:
        prepare_inputs(RECIPE, [f"model.path={weights.parent}", f"run.output_dir={out}"], 1, "cpu")
    assert err.value.where == "model.path" and err.value.what.startswith(problem)
    assert "\n" not in str(err.value) and "copy the folder again" in err.value.fix
    assert not out.exists()  # nothing written
    with pytest.raises(UserError) as err:
        load_model(ModelConfig(path=str(weights.parent)), 10, 0)
    assert err.value.where == "model.path" and err.value.what.startswith(problem)


def test_saved_folder_round_trip(saved_folder):
    cfg = ModelConfig(path=str(saved_folder), dtype="bfloat16")
    tok = load_tokenizer(cfg)
    text = "a b\n\tc  "
    assert tok.decode(tok(text)["input_ids"]) == text  # the char-level pipeline survives save/load
    assert tok.padding_side == "left" and tok.pad_token_id == 0
    model = load_model(cfg, vocab_size=0, seed=99)  # vocab_size and seed only shape builtin models
    expected = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, seed=5)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, expected.lm_head.weight.to(torch.bfloat16))


def test_folder_tokenizer_without_pad_uses_eos(tmp_path, saved_folder):
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_text((saved_folder / name).read_text())
    tok_cfg = json.loads((saved_folder / "tokenizer_config.json").read_text())
    tok_cfg.pop("pad_token")
    tok_cfg["padding_side"] = "right"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    tok = load_tokenizer(ModelConfig(path=str(tmp_path)))
    assert tok.pad_token == "<eos>" and tok.pad_token_id == 1
    assert tok.padding_side == "left"


def test_a_qwen2_folder_loads_the_tokenizer_class_it_saved(tmp_path):
    """transformers' AutoTokenizer (5.x) loads Qwen2Tokenizer from any qwen2 folder, whatever class
    it saved, and reads other ids (the first two assertions pin that cause); load_tokenizer loads
    the saved class and reads the saved tokenizer's ids. A folder that saved Qwen2Tokenizer keeps
    it."""
    saved = build_tiny_tokenizer()
    Qwen2Config(vocab_size=len(saved)).save_pretrained(tmp_path)
    saved.save_pretrained(tmp_path)
    text = "a b\n\tc  "
    overridden = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(overridden).__name__ == "Qwen2Tokenizer"
    assert overridden(text)["input_ids"] != saved(text)["input_ids"]
    tok = load_tokenizer(ModelConfig(path=str(tmp_path)))
    assert type(tok) is type(saved)
    assert tok(text)["input_ids"] == saved(text)["input_ids"]
    tok_cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert type(load_tokenizer(ModelConfig(path=str(tmp_path)))).__name__ == "Qwen2Tokenizer"


@pytest.mark.slow
def test_zero3_loads_partitioned_and_identical_at_world_size_2(tmp_path):
    """Each rank holds ceil(numel / 2) of every weight from the start (builtin:tiny and a saved HF
    folder); the gathered weights and the logits equal a plain load exactly; LoRA trains on the
    partitioned base."""
    from tests.launch import REPO, deepspeed_launch

    folder = tmp_path / "hf"
    build_tiny_model(64, hidden_size=32, num_layers=2, num_heads=4, seed=7).save_pretrained(folder)
    deepspeed_launch(
        2,
        [str(REPO / "tests" / "scripts" / "partitioned_load_check.py"), str(tmp_path), str(folder)],
    )
    result = json.loads((tmp_path / "result.json").read_text())
    for kind in ("tiny", "hf"):
        r = result[kind]
        assert r["shards_ok"] and r["weights_equal"] and r["logits_equal"], (kind, r)
        # 9 per layer, embedding, final norm, lm_head: nothing skipped
        assert r["weights_compared"] == 2 * 9 + 3
        # 1/2 of the model (each tensor rounded up)
        assert r["local"] <= r["total"] / 2 + 64, (kind, r)
    assert result["lora_trainable_partitioned"] and result["lora_loss"] == result["lora_loss"]
