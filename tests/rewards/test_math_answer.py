"""math_equivalence: extraction, normalisation and exact rational comparison, one literal pair per
case."""

from fractions import Fraction

import pytest

from grpo_ds.rewards.math_answer import extract_final_answer, math_equivalence, normalize, to_number


def equiv(completion: str, answer) -> float | None:
    return math_equivalence(
        prompts=["q"], completions=[completion], completion_ids=[[1]], answer=[answer]
    )[0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        # integers, decimals, signs
        ("42", "42", 1.0),
        ("The answer is 42.", "42", 1.0),  # last number, trailing period
        ("\\boxed{2.0}", "2", 1.0),
        ("\\boxed{0.50}", "0.5", 1.0),
        ("\\boxed{.5}", "0.5", 1.0),
        ("\\boxed{0.50}", ".5", 1.0),
        ("\\boxed{+5}", "5", 1.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{-3}", "3", 0.0),
        ("The answer is \u22123", "-3", 1.0),  # unicode minus
        ("so 3 - 5 = -2", "-2", 1.0),
        ("-.5", "-1/2", 1.0),
        ("\\boxed{1e3}", "1000", 1.0),
        ("\\boxed{3}", "4", 0.0),
        # fractions, compared exactly
        ("\\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\tfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{6}{4}}", "3/2", 1.0),
        ("\\boxed{\\frac{6}{4}}", "1.5", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{\\frac{-1}{2}}", "-1/2", 1.0),
        ("\\boxed{0.1}", "1/10", 1.0),
        ("the ratio is 3/4.", "0.75", 1.0),  # a/b as the last number
        ("so we get \\frac{3}{4}", "0.75", 1.0),  # a LaTeX fraction as the last number
        ("\\boxed{0.333}", "1/3", 0.0),  # exact arithmetic: no float tolerance
        ("\\boxed{0.3333333333333333}", "1/3", 0.0),
        ("\\boxed{\\frac{3}{0}}", "3", 0.0),  # not a number
        # too large to be an answer: not parsed (and no hang)
        ("\\boxed{1e999999999999}", "1", 0.0),
        ("\\boxed{2\\frac{1}{2}}", "2.5", 0.0),  # mixed numbers are not evaluated (documented)
        # thousands separators
        ("#### 1,000", "1000", 1.0),
        ("It costs $1,234.50 in total", "1234.5", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("\\boxed{10\\,000}", "10000", 1.0),
        ("\\boxed{1\\!000}", "1000", 1.0),
        ("\\boxed{1,2}", "12", 0.0),  # not a thousands separator
        # simple LaTeX
        ("$\\boxed{7}$", "7", 1.0),
        ("\\boxed{ 7 }", "7", 1.0),
        ("\\boxed 7", "7", 1.0),
        ("\\fbox{7}", "7", 1.0),
        ("\\boxed{\\$5}", "5", 1.0),
        ("\\boxed{\\$1{,}000}", "1000", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{90^{\\circ}}", "90", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units in \text are dropped when a number is left
        ("\\boxed{12 \\mbox{ inches}}", "12", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),  # otherwise \text is unwrapped
        ("\\boxed{\\left(3\\right)}", "(3)", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{(1,2)}", "(2,1)", 0.0),
        ("\\boxed{x = 5}", "5", 1.0),  # a leading "x =" is dropped
        ("\\boxed{\\displaystyle \\frac{1}{2}}", "0.5", 1.0),
        # nested braces; string comparison
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
        ("\\boxed{5 apples}", "5", 0.0),  # units outside \text{} are not guessed
        # percentages: the sign is dropped, not divided by 100
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{50\\%}", "50\\%", 1.0),
        ("The discount is 50%.", "50", 1.0),
        ("\\boxed{50\\%}", "0.5", 0.0),
        # plain strings as the fallback
        ("\\boxed{A}", "A", 1.0),
        ("\\boxed{A}", "a", 0.0),
        ("\\boxed{\\infty}", "\\infty", 1.0),
        # which answer is taken
        ("\\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box
        ("#### 3 but \\boxed{4}", "4", 1.0),  # a box beats ####
        ("first 3, then 4", "4", 1.0),  # the last number
        ("#### 5\nQuestion: what is 2 + 5? 7", "5", 1.0),  # the first line after ####
        ("#### $18 dollars", "18", 1.0),  # not a number: the first number on that line
        ("#### ", "5", 0.0),
        ("\\boxed{}", "0", 0.0),
        ("\\boxed{12", "12", 1.0),  # a truncated box: what is there
        ("10-5", "-5", 0.0),  # "-" after a digit is a minus, not a sign
        ("no numbers here", "4", 0.0),
        ("", "4", 0.0),
        # the reference goes through box and #### extraction, else is taken whole
        ("\\boxed{18}", "Janet has 16 - 3 - 4 = 9 eggs... #### 18", 1.0),
        ("18", "so the answer is \\boxed{18}", 1.0),
        ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
    ],
)
def test_math_equivalence(completion, answer, expected):
    assert equiv(completion, answer) == expected


def test_numeric_answer_column_and_missing_reference():
    assert equiv("\\boxed{18}", 18) == 1.0  # a JSON number column
    assert equiv("\\boxed{0.5}", 0.5) == 1.0
    assert equiv("\\boxed{18}", None) is None  # no reference: no score


def test_missing_answer_column_says_which_column():
    with pytest.raises(ValueError, match="'answer'"):
        math_equivalence(prompts=["q"], completions=["1"], completion_ids=[[1]])


def test_scores_each_item():
    out = math_equivalence(
        prompts=["a", "b", "c"],
        completions=["\\boxed{1}", "#### 3", "x"],
        completion_ids=[[1], [2], [3]],
        answer=["1", "2", None],
        level=["e", "h", "h"],
    )
    assert out == [1.0, 0.0, None]


@pytest.mark.parametrize(
    "text, value",
    [
        ("0.50", Fraction(1, 2)),
        ("-1/4", Fraction(-1, 4)),
        ("\\frac{3}{6}", Fraction(1, 2)),
        ("\\frac12", Fraction(1, 2)),
        ("-\\frac{2.5}{5}", Fraction(-1, 2)),
        ("1e-2", Fraction(1, 100)),
        ("abc", None),
        ("1/0", None),
        ("1e999999999999", None),
    ],
)
def test_to_number(text, value):
    assert to_number(text) == value


def test_helpers():
    assert extract_final_answer("no answer") is None
    assert extract_final_answer("\\boxed{\\frac{1}{2}} and more") == "\\frac{1}{2}"
    assert normalize(" $1{,}000.$ ") == "1000"
    assert normalize("\\text{(A)}") == "(A)"
