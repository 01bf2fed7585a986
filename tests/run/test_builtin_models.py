"""grpo_ds.run.builtin_models: ``builtin:digitD`` written on first use into grpo_ds's cache, whole,
once, also when several processes ask at once."""

import multiprocessing

import pytest

from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.errors import UserError
from grpo_ds.model.reward_model_checks import check_reward_model
from grpo_ds.run.builtin_models import BUILTIN_VERSION, builtin_reward_model, cache_folder


def test_a_builtin_digit_model_is_written_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_DS_CACHE", str(tmp_path / "cache"))
    assert cache_folder() == tmp_path / "cache"
    folder = builtin_reward_model("reward.models[0].path", "builtin:digit3")
    assert folder == tmp_path / "cache" / "builtin" / f"digit3_rm-v{BUILTIN_VERSION}"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    # the pre-load checks pass on it: a whole folder, no temporary one left beside it
    check_reward_model("reward.models[0]", RewardModelSpec(path=str(folder)))
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [
        folder.name
    ]
    again = builtin_reward_model("reward.models[0].path", "builtin:digit3")
    assert again == folder and (folder / "model.safetensors").stat().st_mtime_ns == written


def test_other_paths_are_not_builtin_and_an_unknown_builtin_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_DS_CACHE", str(tmp_path / "cache"))
    assert builtin_reward_model("w", "models/digit7_rm") is None
    with pytest.raises(UserError) as refused:
        builtin_reward_model("reward.models[1].path", "builtin:digits")
    assert str(refused.value).startswith(
        "reward.models[1].path: unknown builtin reward model 'builtin:digits'. the builtin reward "
        'models are "builtin:digit0" to "builtin:digit9"'
    )
    assert "\n" not in str(refused.value) and not (tmp_path / "cache").exists()


def test_a_builtin_models_metrics_name_is_its_own():
    assert RewardModelSpec(path="builtin:digit7").name == "digit7"
    assert RewardModelSpec(path="models/my_rm/").name == "my_rm"


def _ask(cache: str) -> str:
    import os

    os.environ["GRPO_DS_CACHE"] = cache
    return str(builtin_reward_model("w", "builtin:digit5"))


def test_ranks_asking_at_once_find_one_whole_folder(tmp_path):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        folders = pool.map(_ask, [str(tmp_path)] * 3)
    assert len(set(folders)) == 1
    folder = tmp_path / "builtin" / f"digit5_rm-v{BUILTIN_VERSION}"
    assert folders[0] == str(folder)
    check_reward_model("reward.models[0]", RewardModelSpec(path=folders[0]))
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [
        folder.name
    ]
