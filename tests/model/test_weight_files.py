"""Weight files checked from their headers (grpo_ds.model.weight_files): a safetensors or PyTorch
file cut short, of garbage bytes or longer than its header says, a sharded model missing a shard,
and a folder without weights are each named with what is wrong; a complete file passes. Each
refusal of a safetensors file is one the safetensors library makes too (the check says earlier what
loading would say later), and each damaged PyTorch file is one torch.load refuses."""

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from grpo_ds.errors import UserError
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.model.weight_files import (
    check_model_weights,
    file_problem,
    is_damaged_file_error,
    model_weights_problem,
)

TENSORS = {"a": torch.arange(600.0).reshape(20, 30), "b": torch.ones(7, dtype=torch.int64)}


@pytest.fixture
def good(tmp_path) -> Path:
    save_file(TENSORS, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def _library_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                f.get_tensor(name)
    except SafetensorError:
        return True
    return False


def test_a_complete_safetensors_file_passes(good):
    assert file_problem(good) is None and not _library_refuses(good)


@pytest.mark.parametrize(
    "cut, expected",
    [
        (0.5, "is cut short: {size:,} of its {full:,} bytes are there (50%"),
        (0.999, "is cut short: {size:,} of its {full:,} bytes are there"),
        (None, "is cut short: its header alone is"),  # within the header
        (4, "is cut short or not a safetensors file (4 bytes, no 8-byte header length)"),
    ],
)
def test_a_safetensors_file_cut_short_is_named(good, cut, expected):
    data = good.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    size = {None: 8 + length // 2, 4: 4}.get(cut) or int(len(data) * cut)
    good.write_bytes(data[:size])
    assert file_problem(good).startswith(expected.format(size=size, full=len(data)))
    assert _library_refuses(good)


@pytest.mark.parametrize(
    "garbage, expected",
    [
        (b"\x00garbage" * 1000, "is not a safetensors file (its first 8 bytes give a header"),
        (struct.pack("<Q", 12) + b"not json!!!!" + bytes(50), "its header is not JSON"),
        (struct.pack("<Q", 4) + b"[1] ", "its header is not a JSON object"),
    ],
)
def test_garbage_is_not_a_safetensors_file(good, garbage, expected):
    good.write_bytes(garbage)
    assert expected in file_problem(good)
    assert _library_refuses(good)


def test_a_file_longer_than_its_header_says_is_refused_as_the_library_does(good):
    good.write_bytes(good.read_bytes() + b"xx")
    assert file_problem(good).startswith("is 2 bytes longer than its header describes")
    assert _library_refuses(good)


def test_a_header_whose_tensors_leave_a_gap_is_damaged(good):
    data = good.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["b"]["data_offsets"] = [x + 8 for x in header["b"]["data_offsets"]]
    raw = json.dumps(header).encode()
    good.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :] + bytes(8))
    assert "leave a gap" in file_problem(good)
    assert _library_refuses(good)


def test_a_file_that_cannot_be_read_says_why(tmp_path):
    folder = tmp_path / "model.safetensors"  # opening a folder fails as a file without rights does
    folder.mkdir()
    assert file_problem(folder) == "cannot be read (Is a directory)"


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_pytorch_files_cut_short_or_of_garbage(tmp_path, suffix):
    path = tmp_path / f"weights{suffix}"
    torch.save(TENSORS, path)
    assert file_problem(path) is None
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert file_problem(path) == (
        "is cut short or damaged: a zip archive whose central directory (written last) is gone"
    )
    with pytest.raises(RuntimeError, match="PytorchStreamReader") as err:
        torch.load(path)
    assert is_damaged_file_error(err.value)
    path.write_bytes(b"\x00garbage" * 100)
    assert file_problem(path) == "is not a PyTorch file (neither a zip archive nor a pickle)"
    with pytest.raises(pickle.UnpicklingError) as err:
        torch.load(path)
    assert is_damaged_file_error(err.value)
    assert not is_damaged_file_error(RuntimeError("CUDA out of memory"))


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    return folder


def test_a_folder_without_weights_names_what_it_looked_for(tmp_path):
    folder = _folder(tmp_path)
    assert model_weights_problem(folder) == (
        f"{folder} holds no weights (none of model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json)"
    )


def test_safetensors_is_checked_where_transformers_would_load_it(tmp_path, good):
    folder = _folder(tmp_path)
    shutil.copy(good, folder / "model.safetensors")
    torch.save(TENSORS, folder / "pytorch_model.bin")
    (folder / "pytorch_model.bin").write_bytes(b"garbage")  # not loaded: safetensors comes first
    assert model_weights_problem(folder) is None
    (folder / "model.safetensors").unlink()
    assert model_weights_problem(folder) == (
        f"{folder / 'pytorch_model.bin'} is not a PyTorch file (neither a zip archive nor a pickle)"
    )


def test_every_shard_of_an_index_is_checked(tmp_path, good):
    folder = _folder(tmp_path)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for shard in shards:
        shutil.copy(good, folder / shard)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1], "c": shards[1]}}))
    check_model_weights("model.path", folder)
    data = (folder / shards[1]).read_bytes()
    (folder / shards[1]).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError) as err:
        check_model_weights("model.path", folder)
    message = str(err.value)
    assert err.value.where == "model.path" and "\n" not in message
    assert f"{folder / shards[1]} is cut short" in message and "copy the folder again" in message
    (folder / shards[1]).unlink()
    assert model_weights_problem(folder) == (
        f"{folder / shards[1]} is missing (named in {folder}/model.safetensors.index.json)"
    )
    index.write_text("{")
    assert "model.safetensors.index.json cannot be read as a weights index" in (
        model_weights_problem(folder)
    )
    index.write_text('{"metadata": {}}')
    assert 'is not a weights index (no "weight_map" object' in model_weights_problem(folder)


@pytest.mark.slow
def test_the_command_lines_name_a_damaged_weights_file_in_one_line_and_exit_2(tmp_path):
    """Issue 51's failed copy through python -m grpo_ds.train (forked from a preloaded process): the
    rm recipe's reward model, and a policy model.path, with model.safetensors cut to half; the dry
    run grpo_ds.check with garbage for the reward model's weights. Each: exit 2, one stderr line
    naming the file and what is wrong, no traceback, nothing written."""
    from grpo_ds.reward_models.tiny import write_digit_reward_model
    from tests.launch import REPO, clean_env
    from tests.scripts.cli_forks import run_forked

    reward_model = write_digit_reward_model(tmp_path / "digit7_rm")
    policy = tmp_path / "policy"
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), hidden_size=32, num_layers=1, num_heads=4).save_pretrained(
        policy
    )
    tokenizer.save_pretrained(policy)
    garbage_rm = Path(shutil.copytree(reward_model, tmp_path / "garbage_rm"))
    (garbage_rm / "model.safetensors").write_bytes(b"\x00garbage" * 1000)
    for weights in (reward_model / "model.safetensors", policy / "model.safetensors"):
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    rm_recipe, tiny_recipe = (
        REPO / "recipes" / "rm_tiny_cpu.json",
        REPO / "recipes" / "tiny_cpu.json",
    )
    models = '[{{"path": "{}", "name": "digit7", "std": 0.279}}]'
    cases = [
        ("grpo_ds.train", rm_recipe, [f"reward.models={models.format(reward_model)}"]),
        ("grpo_ds.train", tiny_recipe, [f"model.path={policy}"]),
        ("grpo_ds.check", rm_recipe, [f"reward.models={models.format(garbage_rm)}"]),
    ]
    commands = []
    for i, (module, recipe, overrides) in enumerate(cases):
        workdir = tmp_path / f"work{i}"
        workdir.mkdir()
        commands.append(([module, str(recipe), *overrides, "run.output_dir=out"], workdir))
    expected = [
        f"error: reward.models[0].path: {reward_model / 'model.safetensors'} is cut short: ",
        f"error: model.path: {policy / 'model.safetensors'} is cut short: ",
        f"error: reward.models[0].path: {garbage_rm / 'model.safetensors'} is not a safetensors "
        "file (its first 8 bytes give a header length of",
    ]
    finished = run_forked(commands, clean_env(), tmp_path / "forks", timeout=300, parallel=1)
    for done, (_, workdir), start in zip(finished, commands, expected, strict=True):
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith(start) and line.endswith(
            "copy the folder again (a copy that did not finish leaves files cut short), or save "
            "the model again with save_pretrained."
        ), line
        assert done.stdout == "" and list(workdir.iterdir()) == []  # nothing printed or written
