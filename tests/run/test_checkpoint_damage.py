"""Damaged checkpoint files (grpo_ds.run.checkpoint): a PyTorch file saved cut short or as garbage
matches its sha256 in the manifest, and is found by its zip structure instead. Chosen automatically,
such a checkpoint is reported and an older one used; named by checkpoint.resume, it is refused in
one line (exit 2 through the command line). A file that verifies but still fails to load is one line
naming it. The checkpoints are a one-rank ZeRO engine's over builtin:tiny, saved in-process."""

import hashlib
import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.errors import UserError
from grpo_ds.model.engine import create_train_engine
from grpo_ds.model.policy import Policy
from grpo_ds.model.tiny import build_tiny_model
from grpo_ds.run import checkpoint
from grpo_ds.run import folder as run_folder

MODEL_STATES = "ds/mp_rank_00_model_states.pt"
FILES = [MODEL_STATES, "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng/rank0.pt"]
CUT_SHORT = "is cut short or damaged: a zip archive whose central directory (written last) is gone"
GARBAGE = "is not a PyTorch file (neither a zip archive nor a pickle)"


def _policy() -> Policy:
    recipe = load_recipe({"train": {"lr": 1e-2}})
    model = build_tiny_model(64, hidden_size=32, num_layers=1, num_heads=4, seed=0)
    return Policy(
        create_train_engine(model, resolve_deepspeed_config(recipe, 1, "cpu")), False, None, None
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run folder with the checkpoints of steps 1 and 2."""
    run = tmp_path_factory.mktemp("saved") / "run"
    dist, policy = init_distributed(), _policy()
    for step in (1, 2):
        checkpoint.save(policy, run, step, {"sampler": {}, "history": []}, 2, dist)
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == [
        "step_00000002",
        "step_00000001",
    ]
    return run


@pytest.fixture
def run(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "run"))


def _damage(folder: Path, name: str, how: str, rehash: bool = True) -> None:
    """Cut ``name`` to half, or overwrite it with garbage, or zero its pickle inside the zip; with
    ``rehash`` the manifest is written again to match, as for a file that was saved so."""
    path = folder / name
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data = bytearray(b"\x00garbage" * 100)
    else:  # "pickle": the archive whole, its data.pkl zeroed after the first two bytes
        info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("data.pkl"))
        names, extra = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
        start = info.header_offset + 30 + names + extra
        data[start + 2 : start + info.file_size] = bytes(info.file_size - 2)
    path.write_bytes(bytes(data))
    if rehash:
        manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
        manifest["files"][name] = hashlib.sha256(bytes(data)).hexdigest()
        (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("how, problem", [("truncated", CUT_SHORT), ("garbage", GARBAGE)])
@pytest.mark.parametrize("name", FILES)
def test_a_file_saved_damaged_matches_its_sha256_and_is_found_by_its_structure(
    run, name, how, problem
):
    newest = run / checkpoint.CHECKPOINTS / "step_00000002"
    assert checkpoint.verify(newest) is None
    _damage(newest, name, how)
    expected = f"{name} {problem}; it matches its sha256 in manifest.json: it was saved so"
    assert checkpoint.verify(newest) == expected
    # chosen automatically: reported, and the older one used
    chosen, damaged = checkpoint.choose(run)
    assert chosen.name == "step_00000001"
    assert damaged == [f"checkpoint step_00000002 is damaged: {expected}; using an older one"]
    # named by checkpoint.resume: refused in one line, before anything loads
    recipe = load_recipe(
        {"run": {"output_dir": str(run.parent / "out")}, "checkpoint": {"resume": str(newest)}}
    )
    with pytest.raises(UserError) as err:
        run_folder.decide(recipe)
    assert (
        str(err.value)
        == f"checkpoint.resume: the checkpoint is damaged: {expected}. pick another one."
    )


@pytest.mark.parametrize(
    "name, how, what",
    [
        (MODEL_STATES, "truncated", "{folder}/" + MODEL_STATES + " " + CUT_SHORT),
        (MODEL_STATES, "pickle", "{folder}/ds cannot be loaded (invalid load key, '\\x00')"),
        ("rng/rank0.pt", "garbage", "{folder}/rng/rank0.pt " + GARBAGE),
    ],
)
def test_a_file_that_fails_to_load_is_one_line_naming_it(run, name, how, what):
    """Loaded without the verification that comes first in a run (grpo_ds.run.folder.decide and
    checkpoint.choose), as a file damaged inside a whole archive is."""
    newest = run / checkpoint.CHECKPOINTS / "step_00000002"
    _damage(newest, name, how, rehash=False)
    with pytest.raises(UserError) as err:
        checkpoint.load(_policy(), newest, init_distributed())
    assert err.value.where == "checkpoint step_00000002" and "\n" not in str(err.value)
    assert err.value.what == what.format(folder=newest)
    assert "set checkpoint.resume to its folder" in err.value.fix
    assert (
        checkpoint.load(
            _policy(), run / checkpoint.CHECKPOINTS / "step_00000001", init_distributed()
        ).step
        == 1
    )


@pytest.mark.slow
def test_the_command_line_refuses_a_damaged_checkpoint_named_by_resume(run, tmp_path):
    """python -m grpo_ds.train with checkpoint.resume naming a checkpoint whose model states were
    saved cut short: exit 2, one stderr line naming the file, no traceback, no checkpoint loaded."""
    from tests.launch import REPO, clean_env
    from tests.scripts.cli_forks import run_forked

    newest = run / checkpoint.CHECKPOINTS / "step_00000002"
    _damage(newest, MODEL_STATES, "truncated")
    workdir = tmp_path / "work"
    workdir.mkdir()
    argv = [
        "grpo_ds.train",
        str(REPO / "recipes" / "tiny_cpu.json"),
        "run.output_dir=out",
        f"checkpoint.resume={newest}",
    ]
    [done] = run_forked([(argv, workdir)], clean_env(), tmp_path / "forks", timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [
        f"error: checkpoint.resume: the checkpoint is damaged: {MODEL_STATES} {CUT_SHORT}; it "
        "matches its sha256 in manifest.json: it was saved so. pick another one."
    ]
    # the run lock's folder is made before the run folder's decision; nothing is in it
    assert [p for p in workdir.rglob("*") if p.is_file()] == []
