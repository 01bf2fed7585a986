"""A reward model's input (grpo_ds.reward_models.render): the text under its chat template or plain,
its own tokenizer's ids, and what happens past max_length."""

import pytest

from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.errors import UserError
from grpo_ds.model.tiny import build_tiny_tokenizer
from grpo_ds.reward_models.render import render, render_texts
from grpo_ds.reward_models.tiny import build_reward_tokenizer

TOKENIZER = build_reward_tokenizer()


def spec(**kw) -> RewardModelSpec:
    return RewardModelSpec(path="unused", name="rm", **kw)


def test_the_chat_template_renders_the_conversation_and_adds_no_second_bos():
    ids, truncated = render(spec(), TOKENIZER, ["Hi"], ["7!"])
    assert render_texts(spec(), TOKENIZER, ["Hi"], ["7!"]) == [
        "<s><|user|>\nHi<|end|>\n<|assistant|>\n7!<|end|>\n"
    ]
    assert TOKENIZER.convert_ids_to_tokens(ids[0]) == [
        "<s>",
        "<|user|>",
        "\n",
        "H",
        "i",
        "<|end|>",
        "\n",
        "<|assistant|>",
        "\n",
        "7",
        "!",
        "<|end|>",
        "\n",
    ]
    assert truncated == 0


def test_without_the_template_the_text_is_prompt_plus_completion():
    ids, _ = render(spec(chat_template=False), TOKENIZER, ["ab", "x"], ["c", ""])
    assert [TOKENIZER.decode(i) for i in ids] == ["abc", "x"]


def test_the_reward_models_ids_are_not_the_policys():
    policy = build_tiny_tokenizer()
    ids, _ = render(spec(chat_template=False), TOKENIZER, ["What is 3 + 4?"], [" 7"])
    assert ids[0] == TOKENIZER("What is 3 + 4? 7")["input_ids"]
    assert all(a != b for a, b in zip(ids[0], policy("What is 3 + 4? 7")["input_ids"], strict=True))


def test_truncate_left_keeps_the_end_and_counts():
    ids, truncated = render(
        spec(chat_template=False, max_length=4), TOKENIZER, ["abc", "abcdef", "ab"], ["d", "gh", ""]
    )
    assert [TOKENIZER.decode(i) for i in ids] == ["abcd", "efgh", "ab"]
    assert truncated == 1
    _, none = render(spec(chat_template=False), TOKENIZER, ["abcdef"], ["gh"], max_length=None)
    assert none == 0
    # the model's window
    _, window = render(spec(chat_template=False), TOKENIZER, ["abcdef"], ["gh"], max_length=3)
    assert window == 1


def test_error_overflow_is_one_line_naming_the_sample_and_the_fix():
    with pytest.raises(UserError) as err:
        render(
            spec(chat_template=False, max_length=4, overflow="error"),
            TOKENIZER,
            ["ab", "abcdef"],
            ["c", "g"],
            first_sample=10,
        )
    message = str(err.value)
    assert "\n" not in message
    assert (
        "sample 11 is 7 tokens long" in message
        and "max_length 4" in message
        and "truncate_left" in message
    )
