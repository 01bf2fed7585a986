"""The run folder across attempts of the same command (grpo_ds/run/folder.py): an interrupted run
continues, a finished one is left alone, a larger train.steps extends it, and replacing a run says
what it deletes."""

import json

import pytest

import grpo_ds
from grpo_ds.run import checkpoint
from grpo_ds.run import folder as run_folder
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")


def _small(tmp_path, **overrides):
    base = {
        "run.output_dir": str(tmp_path),
        "train.steps": 2,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 4,
        "logging.progress_bar": False,
    }
    base.update(overrides)
    return base


def test_the_tiny_recipes_never_replace_a_run():
    """The README's command may be re-run after a crash: its recipes must not wipe the run
    folder."""
    for path in sorted((REPO / "recipes").glob("*.json")):
        assert json.loads(path.read_text())["run"].get("overwrite", False) is False, path.name


def test_a_resumed_run_may_change_how_the_hf_engine_decodes_but_not_what_it_trains(tmp_path):
    """rollout.hf_compile's default changed from "off" to "auto": a run folder saved before still
    resumes."""
    from grpo_ds.config.loading import load_recipe

    saved = load_recipe(
        TINY, ["rollout.hf_compile=off", "rollout.hf_compile_timeout_s=300"]
    ).to_dict()
    (tmp_path / "recipe.json").write_text(json.dumps(saved))
    assert (
        run_folder._first_difference(tmp_path / "recipe.json", load_recipe(TINY).to_dict()) is None
    )
    assert (
        run_folder._first_difference(
            tmp_path / "recipe.json", load_recipe(TINY, ["train.lr=0.5"]).to_dict()
        )
        == "train.lr was 0.001, the recipe says 0.5"
    )


@pytest.mark.slow
def test_the_same_command_again_does_nothing_for_a_finished_run_and_a_larger_steps_extends_it(
    tmp_path, capsys
):
    run_dir = tmp_path / "tiny_cpu"
    first = grpo_ds.train(TINY, _small(tmp_path))
    assert json.loads((run_dir / run_folder.COMPLETE).read_text())["steps"] == 2
    written = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()

    again = grpo_ds.train(TINY, _small(tmp_path))
    assert (
        f"the run in {run_dir} has already finished its 2 steps: nothing to do"
        in capsys.readouterr().err
    )
    assert again == json.loads(json.dumps(first))  # the logged history, from metrics.jsonl
    # nothing touched
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == written

    extended = grpo_ds.train(TINY, _small(tmp_path, **{"train.steps": 3}))
    assert "resuming after step 2" in capsys.readouterr().err
    assert [m["step"] for m in extended] == [1, 2, 3]
    assert json.loads((run_dir / run_folder.COMPLETE).read_text())["steps"] == 3
    assert checkpoint.latest_name(run_dir) == checkpoint.checkpoint_name(3)


@pytest.mark.slow
def test_replacing_a_run_says_what_it_deletes(tmp_path, capsys):
    grpo_ds.train(TINY, _small(tmp_path, **{"train.steps": 1}))
    capsys.readouterr()
    grpo_ds.train(TINY, _small(tmp_path, **{"train.steps": 1, "run.overwrite": True}))
    err = capsys.readouterr().err
    assert (
        f"replacing the run folder {tmp_path / 'tiny_cpu'} (run.overwrite is true): 1 "
        "checkpoint(s) (newest step_00000001) and the metrics of 1 step(s) deleted"
    ) in err


@pytest.mark.slow
def test_data_that_changed_under_a_run_stops_its_resume_unless_told_to_continue(tmp_path, capsys):
    """data.train shrunk from 40 to 10 rows between a run and its resume: one line naming the change
    (no traceback); with data.on_change="continue" the run goes on, a new pass over the new rows;
    the same length with an edited row is a change too."""
    from grpo_ds.errors import UserError

    data = tmp_path / "arith.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = _small(
        tmp_path, **{"data.train": str(data), "train.steps": 4, "checkpoint.every_steps": 2}
    )
    grpo_ds.train(TINY, run)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    longer = {**run, "train.steps": 6}
    with pytest.raises(UserError) as err:
        grpo_ds.train(TINY, longer)
    assert str(err.value).startswith(
        f"data.train: changed since the run in {tmp_path / 'tiny_cpu'} started: it held "
        "40 prompts, now 10."
    ) and "data.on_change" in str(err.value)
    capsys.readouterr()
    metrics = grpo_ds.train(TINY, {**longer, "data.on_change": "continue"})
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert "a new pass over the changed data begins" in capsys.readouterr().err
    recorded = json.loads((tmp_path / "tiny_cpu" / run_folder.DATA).read_text())
    assert recorded["prompts"] == 10  # the run now records the data it trains on
    data.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:9] + [{"prompt": "9+9=", "answer": "19"}])
    )
    with pytest.raises(UserError, match="its 10 prompts differ"):
        grpo_ds.train(TINY, {**longer, "train.steps": 8})


def test_a_run_folder_from_before_a_key_existed_resumes_when_the_key_is_at_its_default(tmp_path):
    """An older grpo_ds wrote recipe.json without keys added since (here reward.chunk_samples): the
    run is the same recipe's while the new key is at its default, and another recipe's when it is
    not."""
    from grpo_ds.config.loading import load_recipe
    from grpo_ds.errors import UserError

    recipe = load_recipe(TINY, {"run.output_dir": str(tmp_path)})
    folder = tmp_path / "tiny_cpu"
    folder.mkdir()
    saved = recipe.to_dict()
    del saved["reward"]["chunk_samples"]
    (folder / "recipe.json").write_text(json.dumps(saved))
    (folder / "metrics.jsonl").write_text("")
    assert not run_folder.decide(recipe).fresh
    with pytest.raises(UserError, match=r"reward.chunk_samples was null, the recipe says 8"):
        run_folder.decide(
            load_recipe(TINY, {"run.output_dir": str(tmp_path), "reward.chunk_samples": 8})
        )
