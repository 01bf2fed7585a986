"""The reward models built in code (grpo_ds.reward_models.tiny): the reward tokenizer's own
vocabulary, and the hand-set digit model whose score rises with the share of its digit, checked
numerically against its formula, saved by the documented command and scored through the scorer;
``builtin:digitD`` written on first use into grpo_ds's cache, whole, once."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.errors import UserError
from grpo_ds.model.reward_model_checks import check_reward_model
from grpo_ds.model.tiny import build_tiny_tokenizer
from grpo_ds.reward_models.scorer import RewardModels
from grpo_ds.reward_models.tiny import (
    BUILTIN_VERSION,
    build_digit_reward_model,
    build_reward_tokenizer,
    build_tiny_reward_model,
    builtin_reward_model,
    cache_folder,
    digit_score,
    main,
)
from tests.scripts.reward_model_scores import ds_config

# fp32 rounding plus RMSNorm's epsilon (1e-6 inside a square root); measured ~1e-6
FORMULA_TOLERANCE = 2e-6


def test_the_reward_tokenizer_has_another_vocabulary_than_builtin_tiny():
    reward, policy = build_reward_tokenizer(), build_tiny_tokenizer()
    shared = [c for c in "abcXYZ0123456789 .!?\n"]
    assert all(reward.convert_tokens_to_ids(c) != policy.convert_tokens_to_ids(c) for c in shared)
    assert reward.pad_token_id is not None and reward.chat_template
    assert reward.decode(reward("Hello, 7!")["input_ids"]) == "Hello, 7!"


def test_the_random_reward_model_is_seeded():
    tokenizer = build_reward_tokenizer()
    ids = torch.tensor([tokenizer("some text")["input_ids"]])
    a, b, c = (build_tiny_reward_model(tokenizer, seed)(input_ids=ids).logits for seed in (0, 0, 1))
    assert a.shape == (1, 1) and torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("digit", ["7", "0"])
def test_the_digit_models_score_is_its_formula_and_rises_with_the_share(digit):
    tokenizer = build_reward_tokenizer()
    model = build_digit_reward_model(tokenizer, digit)
    other = "a" if digit != "a" else "b"
    scores = []
    for count in range(9):  # 0..8 digits among 8 characters plus the template's tokens
        text = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "Go"},
                {"role": "assistant", "content": digit * count + other * (8 - count)},
            ],
            tokenize=False,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            score = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert abs(score - digit_score(count / len(ids))) <= FORMULA_TOLERANCE
        scores.append(score)
    assert scores[0] == 0.0
    # strictly rising, by a margin learning can see
    assert all(b - a > 0.01 for a, b in zip(scores, scores[1:], strict=False))
    assert (
        abs(model(input_ids=torch.tensor([tokenizer(digit * 5)["input_ids"]])).logits.item() - 1.0)
        <= 1e-6
    )


def test_the_documented_command_writes_a_folder_the_scorer_reads(tmp_path, capsys):
    """`python -m grpo_ds.reward_models.tiny FOLDER --digit 3`, through its main in this process (a
    fresh interpreter would spend ~10 s importing transformers on the CI's CPU)."""
    folder = tmp_path / "digit_rm"
    main([str(folder), "--digit", "3"])
    assert "rewards the digit 3" in capsys.readouterr().err
    assert AutoModelForSequenceClassification.from_pretrained(folder).config.num_labels == 1
    assert AutoTokenizer.from_pretrained(folder).convert_ids_to_tokens(
        AutoTokenizer.from_pretrained(folder)("3")["input_ids"]
    ) == ["3"]
    dist = init_distributed()
    models = RewardModels.build(
        [RewardModelSpec(path=str(folder), name="threes")], ds_config(1, False), dist, 64
    )
    completions = ["3" * k + "x" * (6 - k) for k in range(7)]
    scores = models.score_models(["Say 3."] * 7, completions, dist).scores["threes"]
    assert all(b > a for a, b in zip(scores, scores[1:], strict=False))


def test_a_builtin_digit_model_is_written_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_DS_CACHE", str(tmp_path / "cache"))
    assert cache_folder() == tmp_path / "cache"
    folder = builtin_reward_model("reward.models[0].path", "builtin:digit3")
    assert folder == tmp_path / "cache" / "builtin" / f"digit3_rm-v{BUILTIN_VERSION}"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    # the pre-load checks pass on it: a whole folder, no temporary one left beside it
    check_reward_model("reward.models[0]", RewardModelSpec(path=str(folder)))
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
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
