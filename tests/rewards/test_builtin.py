"""Built-in rewards: answer extraction, normalisation, exact_match, format and length_penalty."""

import pytest

from grpo_ds.rewards import BUILTIN_REWARDS
from grpo_ds.rewards.builtin import (
    LENGTH_PENALTY_END_TOKENS,
    LENGTH_PENALTY_START_TOKENS,
    exact_match,
    extract_answer,
    format_reward,
    length_penalty,
    make_length_penalty,
    normalize_answer,
)
from grpo_ds.rewards.code_exec import code_exec
from grpo_ds.rewards.math_answer import math_equivalence


def em(completion: str, answer) -> float | None:
    return exact_match(
        prompts=["q"], completions=[completion], completion_ids=[[1]], answer=[answer]
    )[0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("7", "7", 1.0),  # plain digit
        ("  7 \n", "7", 1.0),  # whitespace
        ("Let me think. 6 + 36 = 42\n#### 42", "42", 1.0),  # GSM8K marker
        ("#### 41 #### 42", "42", 1.0),  # last marker wins
        ("so the answer is \\boxed{3}", "3", 1.0),  # boxed
        ("\\boxed{1} then \\boxed{2}", "2", 1.0),  # last box wins
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("1,000", "1000", 1.0),  # thousands separator
        ("#### 1,234,567", "1234567", 1.0),
        ("7.", "7", 1.0),  # trailing period
        ("3.0", "3", 1.0),  # numeric comparison
        ("#### -2.50", "-2.5", 1.0),
        ("8", "7", 0.0),  # wrong answer
        ("The answer is 7", "7", 0.0),  # no marker: the whole completion is the answer
        ("#### 42", "... reasoning #### 42", 1.0),  # reference goes through the same extraction
        ("paris", "paris", 1.0),  # non-numeric: string equality
        ("Paris", "paris", 0.0),
        ("", "7", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert em(completion, answer) == expected


def test_exact_match_int_answer_and_none_answer():
    assert em("12", 12) == 1.0  # a JSON number column
    assert em("12", None) is None  # no reference: no score


def test_exact_match_without_answer_column_says_which_column():
    with pytest.raises(ValueError, match="'answer'"):
        exact_match(prompts=["q"], completions=["1"], completion_ids=[[1]], other=["1"])


def test_exact_match_ignores_unused_columns_and_scores_each_item():
    out = exact_match(
        prompts=["a", "b"],
        completions=["#### 1", "#### 3"],
        completion_ids=[[1], [2]],
        answer=["1", "2"],
        difficulty=["easy", "hard"],
    )
    assert out == [1.0, 0.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("#### 42", 1.0),
        ("\\boxed{3.5}", 1.0),
        ("17", 1.0),
        ("#### 1,000.", 1.0),
        ("#### forty-two", 0.0),  # answer present but not a number
        ("I think 42", 0.0),  # no marker: the whole text is not a number
        ("   \n", 0.0),  # empty
        ("#### nan", 0.0),  # nan/inf are not decimal numbers
    ],
)
def test_format(completion, expected):
    assert format_reward(prompts=["q"], completions=[completion], completion_ids=[[1]]) == [
        expected
    ]


def test_helpers():
    assert extract_answer("\\boxed{12") == "12"  # truncated box: take what is there
    assert normalize_answer(" 1,000. ") == "1000"
    assert normalize_answer("1,2") == "1,2"  # not a thousands-separated number: left alone


def test_registry_names():
    assert BUILTIN_REWARDS == {
        "exact_match": exact_match,
        "format": format_reward,
        "math_equivalence": math_equivalence,
        "length_penalty": length_penalty,
        "code_exec": code_exec,
    }


def penalties(fn, lengths):
    return fn(
        prompts=["q"] * len(lengths),
        completions=["c"] * len(lengths),
        completion_ids=[[7] * n for n in lengths],
    )


def test_length_penalty_shape():
    short = make_length_penalty(4, 8)
    # free up to 4 tokens, then -0.25 per token, -1.0 from 8 tokens on
    assert penalties(short, [0, 3, 4, 5, 6, 7, 8, 100]) == [
        0.0,
        0.0,
        0.0,
        -0.25,
        -0.5,
        -0.75,
        -1.0,
        -1.0,
    ]
    assert all(str(v) != "-0.0" for v in penalties(short, [0, 4]))  # a clean 0.0 in the logs


def test_builtin_length_penalty_defaults():
    start, end = LENGTH_PENALTY_START_TOKENS, LENGTH_PENALTY_END_TOKENS
    assert (start, end) == (512, 1024)
    assert penalties(length_penalty, [start, (start + end) // 2, end, 5000]) == [
        0.0,
        -0.5,
        -1.0,
        -1.0,
    ]


@pytest.mark.parametrize("start, end", [(8, 8), (9, 8), (-1, 8)])
def test_make_length_penalty_rejects_bad_thresholds(start, end):
    with pytest.raises(ValueError, match="start_tokens < end_tokens"):
        make_length_penalty(start, end)
