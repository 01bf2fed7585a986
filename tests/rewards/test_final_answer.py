"""The one final-answer extraction of the built-in rewards: a box before ####, and every reward
agrees."""

import pytest

from grpo_ds.rewards.builtin import exact_match, format_reward
from grpo_ds.rewards.final_answer import MarkedAnswer, extract_answer, marked_answer
from grpo_ds.rewards.math_answer import math_equivalence


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{3}", MarkedAnswer("3", "boxed")),
        ("\\boxed{1} then \\boxed{2}", MarkedAnswer("2", "boxed")),  # the last box
        ("\\fbox{7}", MarkedAnswer("7", "boxed")),
        ("\\boxed{\\frac{1}{2}", MarkedAnswer("\\frac{1}{2}", "boxed")),  # unclosed: what is there
        (
            "#### 41 #### 42\nmore",
            MarkedAnswer(" 42\nmore", "####"),
        ),  # everything after the last ####
        (
            "#### 3 but \\boxed{4}",
            MarkedAnswer("4", "boxed"),
        ),  # a box beats ####, wherever it stands
        ("\\boxed{4} #### 3", MarkedAnswer("4", "boxed")),
        ("7", None),
    ],
)
def test_marked_answer_precedence(text, expected):
    assert marked_answer(text) == expected
    assert extract_answer(text) == (text if expected is None else expected.text)


@pytest.mark.parametrize(
    "completion, reference, score",
    [
        ("#### 3 but \\boxed{4}", "4", 1.0),
        ("\\boxed{4} #### 3", "4", 1.0),
        ("#### 4", "... \\boxed{4} #### 3", 1.0),  # a reference goes through the same extraction
        ("#### 3", "... \\boxed{4} #### 3", 0.0),
    ],
)
def test_exact_match_and_math_equivalence_take_the_same_answer(completion, reference, score):
    kwargs = {
        "prompts": ["q"],
        "completions": [completion],
        "completion_ids": [[1]],
        "answer": [reference],
    }
    assert exact_match(**kwargs) == math_equivalence(**kwargs) == [score]
    assert format_reward(**kwargs) == [1.0]
