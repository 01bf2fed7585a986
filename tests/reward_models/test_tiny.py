"""The reward models built in code (grpo_ds.reward_models.tiny): the reward tokenizer's own
vocabulary, and the hand-set digit model whose score rises with the share of its digit, checked
numerically against its formula, saved by the documented command and scored through the scorer."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.model.tiny import build_tiny_tokenizer
from grpo_ds.reward_models.scorer import RewardModels
from grpo_ds.reward_models.tiny import (
    build_digit_reward_model,
    build_reward_tokenizer,
    build_tiny_reward_model,
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
