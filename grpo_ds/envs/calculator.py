"""The built-in ``calculator`` environment: the model may ask a calculator before it answers.

Protocol, with the defaults (made for the character-level builtin:tiny model and ``builtin:arith``
rows such as ``{"prompt": "3+4=", "answer": "7"}``)::

    model turn "?"       a call (the turn ends at the call string "?"): the calculator evaluates the
                         question, i.e. the row's ``prompt`` without its trailing "=" (here 3+4)
                         -> observation "[7]"
    model turn "2*5?"    a call with an expression: the text before "?" is evaluated      ->
                         observation "[10]"
    a bad expression     (anything but digits, + - * / ( ) and spaces; too long; x/0)    ->
                         observation "[error]"
    any other turn       the final answer: reward 1.0 if it matches the row's ``answer``  -> episode
                         over (compared as the exact_match reward does: whitespace and trailing
                         periods ignored, numbers compared by value), else 0.0

So a full episode is e.g. ``3+4=`` | ``?`` ``[7]`` ``7<eos>``, where ``[7]`` is the observation
(loss mask 0). The first call that returns a value earns ``call_reward`` (0.1 by default; later
calls earn nothing, so repeating calls does not pay); a correct answer after a call therefore scores
1.1, a correct guess 1.0.

Why these defaults: a random character model emits the one-character call "?" about once in a
hundred tokens, so a group of 16 samples regularly contains a call and ``call_reward`` gives GRPO a
signal from the first step; once it calls, answering is copying the digit it just saw, which a tiny
transformer learns far more easily than adding. Multi-character syntaxes such as
``<calc>3+4</calc>`` are never sampled by chance.

Expressions are parsed with ``ast`` and only integer literals, + - * / and unary +/- are evaluated,
exactly with fractions (a non-integer result prints as a decimal, e.g. ``[3.5]``); ``eval`` never
runs. Options (the recipe's ``rollout.env_options``) are the constructor's keyword arguments.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from grpo_ds.envs.base import StepResult
from grpo_ds.rewards.builtin import answers_match

_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/() ]+")


class CalculatorEnv:
    def __init__(
        self,
        call: str = "?",
        result_template: str = "[{}]",
        call_reward: float = 0.1,
        question_key: str = "prompt",
        answer_key: str = "answer",
        max_expression_chars: int = 64,
        max_abs_value: int = 10**9,
    ) -> None:
        if not isinstance(call, str) or not call:
            raise ValueError(f"call must be a non-empty string, got {call!r}")
        if not isinstance(result_template, str) or result_template.count("{}") != 1:
            raise ValueError(
                f'result_template must contain "{{}}" once (for the value), got {result_template!r}'
            )
        if max_expression_chars < 1 or max_abs_value < 1:
            raise ValueError("max_expression_chars and max_abs_value must be >= 1")
        self.call, self.result_template, self.call_reward = (
            call,
            result_template,
            float(call_reward),
        )
        self.question_key, self.answer_key = question_key, answer_key
        self.max_expression_chars, self.max_abs_value = max_expression_chars, max_abs_value
        self.turn_stop = (call,)
        self.question, self.answer, self.called = "", "", False

    def reset(self, row: dict) -> str:
        if row.get(self.answer_key) is None:
            raise ValueError(
                f"the data row has no {self.answer_key!r} column (columns: {', '.join(row)}); "
                "set rollout.env_options.answer_key"
            )
        self.answer = str(row[self.answer_key])
        self.question = str(row.get(self.question_key, "")).strip().rstrip("=").strip()
        self.called = False
        return ""

    def step(self, model_turn: str) -> StepResult:
        head, is_call, _ = model_turn.partition(self.call)
        if not is_call:
            return StepResult("", float(answers_match(model_turn, self.answer)), True)
        value = evaluate(
            head.strip() or self.question, self.max_expression_chars, self.max_abs_value
        )
        if value is None:
            return StepResult(self.result_template.format("error"), 0.0, False)
        reward = 0.0 if self.called else self.call_reward
        self.called = True
        return StepResult(self.result_template.format(format_value(value)), reward, False)


def evaluate(expression: str, max_chars: int = 64, max_abs_value: int = 10**9) -> Fraction | None:
    """The exact value of an arithmetic expression (integers, + - * /, parentheses, unary +/-), or
    None when it is not one, is longer than ``max_chars``, divides by zero, or has a value or
    intermediate value above ``max_abs_value`` in magnitude."""
    if (
        len(expression) > max_chars
        or not _EXPRESSION_CHARS.fullmatch(expression)
        or not expression.strip()
    ):
        return None
    try:
        return _value(ast.parse(expression.strip(), mode="eval").body, max_abs_value)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, _Invalid):
        return None


class _Invalid(Exception):
    pass


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _value(node: ast.AST, limit: int) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_value(node.left, limit), _value(node.right, limit))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand, limit)
        value = -value if isinstance(node.op, ast.USub) else value
    else:
        raise _Invalid
    if abs(value) > limit:
        raise _Invalid
    return value


def format_value(value: Fraction) -> str:
    """``7``, ``-3``, ``3.5``, ``0.333333`` (six significant digits for non-integers)."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"
