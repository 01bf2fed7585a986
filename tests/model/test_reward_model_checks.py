"""Bad reward models are refused before anything loads (grpo_ds.model.reward_model_checks), each
with one line naming the entry's key: a missing folder, a folder without config.json, a model
without a sequence-classification head or with more than one label, weights missing, cut short or
garbage, a length setting the model cannot take, and a tokenizer that is missing, has no token to
pad with, has more tokens than the model, or has no chat template where one is asked for. Model
folders are built from configs in tmp_path (random weights, the builtin tokenizer built in code);
nothing is downloaded. Two cases go through the real command lines (python -m grpo_ds.train and
grpo_ds.check, forked from a preloaded process): exit 2, one line, nothing written."""

import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
from transformers import LlamaForCausalLM, PreTrainedModel

from grpo_ds.config.reward_specs import RewardModelSpec, parse_rewards
from grpo_ds.errors import UserError
from grpo_ds.model.reward_model_checks import check_reward_models
from grpo_ds.run.preflight import prepare_inputs
from tests.reward_models.builders import CONTEXT, write_reward_model
from tests.scripts.cli_forks import run_forked

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_cpu.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_reward_model(tmp_path_factory.mktemp("rm") / "good_rm")


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "rm"))


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def specs(entries: list) -> tuple[RewardModelSpec, ...]:
    """The entries parsed as the recipe's are (grpo_ds.config.reward_specs)."""
    return parse_rewards([], entries).models


def refusal(entries: list) -> UserError:
    with pytest.raises(UserError) as info:
        check_reward_models(specs(entries))
    text = str(info.value)
    assert "\n" not in text and text.endswith("."), text  # one line, the fix a complete sentence
    return info.value


def test_a_good_folder_passes(good):
    check_reward_models(specs([{"path": str(good), "max_length": CONTEXT}]))
    check_reward_models(())


def test_no_model_is_loaded(good, monkeypatch):
    """config.json, the weights' headers and the tokenizer files are read; no weight is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    check_reward_models(specs([{"path": str(good)}]))


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage"])
def test_weights_missing_cut_short_or_garbage(tmp_path, good, damage):
    """The failed copy of issue 51 (model.safetensors cut to half), bytes of another file, or no
    weights at all: refused before anything loads, naming the file."""
    folder = _copy(good, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else bytes(64))
    expected = {
        "missing": f"{folder} holds no weights (none of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json)",
        "truncated": f"{weights} is cut short: {len(data) // 2:,} of its {len(data):,} bytes "
        "are there (50%; incomplete metadata, file not fully covered)",
        "garbage": f"{weights} is not a safetensors file (its header is not JSON: Expecting "
        "value: line 1 column 1 (char 0))",
    }
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].path" and err.what == expected[damage]
    assert "copy the folder again" in err.fix


def test_a_missing_folder(tmp_path):
    err = refusal([{"path": str(tmp_path / "nowhere")}])
    assert (
        err.where == "reward.models[0].path"
        and err.what == f"{tmp_path / 'nowhere'} does not exist"
    )


def test_a_folder_without_config_json(tmp_path, good):
    (tmp_path / "empty").mkdir()
    # the second entry is named
    err = refusal([{"path": str(good)}, {"path": str(tmp_path / "empty")}])
    assert err.where == "reward.models[1].path" and "no config.json in it" in err.what


def test_a_causal_lm_is_not_a_reward_model(tmp_path):
    folder = write_reward_model(tmp_path / "lm", model_cls=LlamaForCausalLM)
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].path"
    assert (
        "holds a LlamaForCausalLM, not a sequence classifier" in err.what
        and "num_labels=1" in err.fix
    )


def test_a_config_without_architectures_is_refused(tmp_path, good):
    folder = _copy(good, tmp_path)
    _edit_json(folder / "config.json", lambda c: c.pop("architectures"))
    assert "names no architectures" in refusal([{"path": str(folder)}]).what


@pytest.mark.parametrize("labels", [2, 3])
def test_more_than_one_label(tmp_path, labels):
    folder = write_reward_model(tmp_path / "cls", num_labels=labels)
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].path" and f"has {labels} labels" in err.what


def test_a_config_that_names_no_labels_has_transformers_default_of_two(tmp_path, good):
    """A classifier saved without num_labels (no id2label in config.json) has 2 labels to
    transformers."""
    folder = _copy(good, tmp_path)
    _edit_json(folder / "config.json", lambda c: (c.pop("id2label"), c.pop("label2id")))
    assert "has 2 labels" in refusal([{"path": str(folder)}]).what


def test_a_max_length_past_the_models_context(good):
    err = refusal([{"path": str(good), "max_length": CONTEXT + 1}])
    assert err.where == "reward.models[0].max_length"
    assert err.what.startswith(
        f"{CONTEXT + 1} is more than the model's context length {CONTEXT} "
        "(max_position_embeddings in "
    )
    assert err.fix == f"use at most {CONTEXT}, or null (= {CONTEXT})"


def test_a_null_max_length_needs_a_context_length_in_the_config(tmp_path, good):
    folder = _copy(good, tmp_path)
    _edit_json(folder / "config.json", lambda c: c.pop("max_position_embeddings"))
    config = json.loads((folder / "config.json").read_text())
    assert not any(key in config for key in ("n_positions", "max_seq_len", "seq_length", "n_ctx"))
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].max_length" and "names none" in err.what
    check_reward_models(specs([{"path": str(folder), "max_length": 64}]))  # a length given: fine


def test_a_max_length_below_two_is_refused_with_the_recipe(good):
    err = refusal([{"path": str(good), "max_length": 1}])  # before any folder is read
    assert err.where == "reward.models[0].max_length" and "must be >= 2" in err.what


def test_no_tokenizer_files(tmp_path):
    folder = write_reward_model(tmp_path / "bare", tokenizer=False)
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].path" and "has no tokenizer files" in err.what


def test_a_tokenizer_without_a_pad_token_passes_and_one_without_any_token_to_pad_with_does_not(
    tmp_path, good
):
    """One rule with the scorer, which pads with the eos or unk token where there is no pad token
    (tests/reward_models/test_scorer.py scores such a model)."""
    folder = _copy(good, tmp_path)
    _edit_json(folder / "tokenizer_config.json", lambda c: c.pop("pad_token"))
    check_reward_models(specs([{"path": str(folder)}]))

    def no_special_tokens(config: dict) -> None:
        for key in ("eos_token", "unk_token"):
            config.pop(key, None)

    _edit_json(folder / "tokenizer_config.json", no_special_tokens)
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].path"
    assert "has no pad, eos or unk token to pad a batch with" in err.what
    assert err.fix == f'set "pad_token" in {folder}/tokenizer_config.json'


def test_a_tokenizer_larger_than_the_models_vocabulary(tmp_path):
    # the tokenizer has 103 tokens
    folder = write_reward_model(tmp_path / "small_vocab", vocab_size=64)
    err = refusal([{"path": str(folder)}])
    assert "has 103 tokens, more than the model's vocabulary of 64" in err.what


def test_chat_template_true_needs_a_template(tmp_path, good):
    folder = _copy(good, tmp_path)
    (folder / "chat_template.jinja").unlink()  # where transformers 5 saves the template
    err = refusal([{"path": str(folder)}])
    assert err.where == "reward.models[0].chat_template" and "has no chat template" in err.what
    assert "set chat_template false" in err.fix
    check_reward_models(specs([{"path": str(folder), "chat_template": False}]))  # plain: needs none


def test_preflight_runs_the_checks_and_hands_over_the_specs(good, tmp_path):
    out = f"run.output_dir={tmp_path / 'out'}"
    inputs = prepare_inputs(
        RECIPE, [out, f'reward.models=[{{"path": "{good}", "weight": 0.5}}]'], 1, "cpu"
    )
    assert [(s.name, s.weight) for s in inputs.reward_models] == [("good_rm", 0.5)]
    with pytest.raises(UserError) as info:
        prepare_inputs(
            RECIPE, [out, f'reward.models=[{{"path": "{tmp_path / "missing"}"}}]'], 1, "cpu"
        )
    assert info.value.where == "reward.models[0].path"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_lines_refuse_with_one_line_and_exit_2(tmp_path, good):
    """python -m grpo_ds.train and grpo_ds.check on a reward model whose tokenizer has no token to
    pad a batch with (no pad, eos or unk token)."""
    folder = _copy(good, tmp_path)

    def no_special_tokens(config: dict) -> None:
        for key in ("pad_token", "eos_token", "unk_token"):
            config.pop(key, None)

    _edit_json(folder / "tokenizer_config.json", no_special_tokens)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    models = f'reward.models=[{{"path": "{folder}"}}]'
    workdirs = [tmp_path / "train", tmp_path / "check"]
    for workdir in workdirs:
        workdir.mkdir()
    commands = [
        (["grpo_ds.train", str(RECIPE), models, f"run.output_dir={workdirs[0]}/out"], workdirs[0]),
        (["grpo_ds.check", str(RECIPE), models, f"run.output_dir={workdirs[1]}/out"], workdirs[1]),
    ]
    for finished, workdir in zip(
        run_forked(commands, env, tmp_path / "forks", timeout=300, parallel=1),
        workdirs,
        strict=True,
    ):
        errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
        assert finished.returncode == 2, finished.stderr
        assert "Traceback" not in finished.stderr, finished.stderr
        assert errors == [
            f"error: reward.models[0].path: the tokenizer in {folder} has no pad, eos or unk token "
            f'to pad a batch with. set "pad_token" in {folder}/tokenizer_config.json.'
        ]
        # nothing printed, nothing written
        assert finished.stdout == "" and list(workdir.iterdir()) == []
