"""The built-in calculator environment: safe evaluation, the call protocol, rewards, options."""

from fractions import Fraction

import pytest

from grpo_ds.envs import BUILTIN_ENVS, CalculatorEnv, StepResult
from grpo_ds.envs.calculator import evaluate, format_value
from grpo_ds.run.prompts import arith_rows


@pytest.mark.parametrize(
    "expression, value",
    [
        ("3+4", 7),
        ("2*(3+4)", 14),
        ("7/2", Fraction(7, 2)),
        ("-3+1", -2),
        (" 10 - 2 * 3 ", 4),
        ("+5", 5),
        ("((1))", 1),
        ("1/3*3", 1),
        ("(" * 30 + "1" + ")" * 30, 1),
    ],
)
def test_evaluate_arithmetic_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "",
        " ",
        "1/0",
        "2**8",
        "7//2",
        "7%2",
        "__import__('os')",
        "1e3",
        "1.5+1",
        "08",
        "3+",
        "()",
        "x",
        "9" * 11,
        "99999*99999",
        "1" + "+1" * 40,
        "(" * 40 + "1" + ")" * 40,
    ],
)
def test_evaluate_refuses_everything_else(expression):
    assert evaluate(expression) is None


def test_limits_are_options():
    assert evaluate("99999*99999", max_abs_value=10**10) == 9999800001
    assert evaluate("1+1", max_chars=2) is None


def test_format_value():
    assert [format_value(Fraction(v)) for v in (7, -3)] == ["7", "-3"]
    assert format_value(Fraction(7, 2)) == "3.5" and format_value(Fraction(1, 3)) == "0.333333"


def test_call_copy_answer_episode_on_an_arith_row():
    row = {"prompt": "3+4=", "answer": "7"}
    assert row in arith_rows()
    env = CalculatorEnv()
    assert env.turn_stop == ("?",) and env.reset(row) == ""
    assert env.step("?") == StepResult("[7]", 0.1, False)  # a bare call evaluates the question
    assert env.step("?") == StepResult("[7]", 0.0, False)  # only the first call is rewarded
    assert env.step("7") == StepResult("", 1.0, True)


def test_calls_with_an_expression_and_bad_calls():
    env = CalculatorEnv()
    env.reset({"prompt": "3+4=", "answer": "7"})
    assert env.step("x?") == StepResult("[error]", 0.0, False)  # a failed call earns nothing
    assert env.step(" 2*5 ?") == StepResult("[10]", 0.1, False)
    assert env.step("1/0?") == StepResult("[error]", 0.0, False)


@pytest.mark.parametrize(
    "turn, reward", [("7", 1.0), (" 7. ", 1.0), ("7.0", 1.0), ("8", 0.0), ("", 0.0), ("7x", 0.0)]
)
def test_final_answers_are_compared_like_exact_match(turn, reward):
    env = CalculatorEnv()
    env.reset({"prompt": "3+4=", "answer": "7"})
    assert env.step(turn) == StepResult("", reward, True)


def test_reset_starts_a_new_episode():
    env = CalculatorEnv()
    env.reset({"prompt": "1+1=", "answer": "2"})
    env.step("?")
    env.reset({"prompt": "2*3=", "answer": 6})  # a numeric answer column works too
    assert env.step("?") == StepResult("[6]", 0.1, False) and env.step("6").reward == 1.0


def test_options():
    env = CalculatorEnv(
        call="CALC", result_template="<r>{}</r>", call_reward=0.0, question_key="q", answer_key="a"
    )
    env.reset({"q": "6*7", "a": "42"})
    assert env.turn_stop == ("CALC",)
    assert env.step("CALC") == StepResult("<r>42</r>", 0.0, False)
    assert env.step("42").reward == 1.0


def test_bad_options_and_rows_raise_value_error():
    with pytest.raises(ValueError, match="call"):
        CalculatorEnv(call="")
    with pytest.raises(ValueError, match="result_template"):
        CalculatorEnv(result_template="no slot")
    with pytest.raises(ValueError, match="answer_key"):
        CalculatorEnv().reset({"prompt": "1+1="})


def test_registered_as_a_builtin():
    assert BUILTIN_ENVS["calculator"] is CalculatorEnv
