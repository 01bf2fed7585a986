"""Built-in reward functions, selected in a recipe by name (``{"name": "exact_match"}``).

``BUILTIN_REWARDS`` lists them all: ``exact_match`` and ``format`` (here), ``math_equivalence``
(``grpo_ds.rewards.math_answer``), ``length_penalty`` (here) and ``code_exec``
(``grpo_ds.rewards.code_exec``). Built-ins take no options in the recipe; the ones with settings
offer a ``make_*`` factory whose result you put in your own module and name as
``my_module:function``.

``exact_match`` and ``format`` take the final answer as every built-in does
(``grpo_ds.rewards.final_answer.extract_answer``):

1. if the text contains ``\\boxed{...}`` (MATH style; or ``\\fbox{...}``), the answer is the content
   of the last box (nested braces are matched);
2. else if it contains ``####`` (GSM8K style), the answer is everything after the last ``####``;
3. else the answer is the whole text.

The extracted answer is then normalised: surrounding whitespace stripped, trailing periods removed
(``"7."`` -> ``"7"``), and thousands separators removed from numbers (``"1,000"`` -> ``"1000"``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from grpo_ds.rewards.code_exec import code_exec
from grpo_ds.rewards.final_answer import extract_answer
from grpo_ds.rewards.math_answer import math_equivalence

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def normalize_answer(text: str) -> str:
    """Strip whitespace and trailing periods; drop thousands separators from a number like
    ``1,000``."""
    s = text.strip()
    while s.endswith("."):
        s = s[:-1].rstrip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def parse_number(text: str) -> float | None:
    """The value of a normalised answer that is a plain decimal number, else None (``nan``/``inf``
    are not)."""
    return float(text) if _NUMBER.fullmatch(text) else None


def answers_match(predicted: str, reference: str) -> bool:
    """Compare two raw texts after extraction and normalisation: numerically if both are numbers."""
    p, r = normalize_answer(extract_answer(predicted)), normalize_answer(extract_answer(reference))
    p_num, r_num = parse_number(p), parse_number(r)
    if p_num is not None and r_num is not None:
        return math.isclose(p_num, r_num, rel_tol=1e-9, abs_tol=1e-12)
    return p == r


def exact_match(
    *, completions: list[str], answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the ``answer`` column's, else 0.0.

    Both sides go through the same extraction and normalisation, so a GSM8K reference such as
    ``"... #### 72"`` works as is. A sample whose reference answer is None gets None (no score).
    """
    if answer is None:
        raise ValueError(
            "exact_match needs a dataset column named 'answer' (set data.answer_key to the column "
            "holding reference answers)"
        )
    return [
        None if ref is None else float(answers_match(text, str(ref)))
        for text, ref in zip(completions, answer, strict=True)
    ]


def format_reward(*, completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion states a numeric final answer, else 0.0.

    Precisely: the stripped completion is non-empty, and its extracted, normalised answer (same
    rules as ``exact_match``) is a plain decimal number. It does not compare with any reference and
    does not know whether generation was truncated.
    """
    return [
        float(
            bool(text.strip()) and parse_number(normalize_answer(extract_answer(text))) is not None
        )
        for text in completions
    ]


# the built-in length_penalty: free up to this many completion tokens,
# then linearly down to -1.0 here, and -1.0 beyond
LENGTH_PENALTY_START_TOKENS = 512
LENGTH_PENALTY_END_TOKENS = 1024


def make_length_penalty(start_tokens: int, end_tokens: int) -> Callable[..., list[float]]:
    """A length penalty: 0.0 up to ``start_tokens`` completion tokens, falling linearly to -1.0 at
    ``end_tokens``.

    Length is ``len(completion_ids[i])``, the generated tokens (EOS included). For other thresholds,
    in your module: ``length_penalty = make_length_penalty(256, 512)``. For a penalty tied to
    ``rollout.max_new_tokens`` use DAPO's soft overlong penalty instead
    (``algorithm.overlong_buffer_tokens``).
    """
    if not 0 <= start_tokens < end_tokens:
        raise ValueError(
            f"need 0 <= start_tokens < end_tokens, got {start_tokens} and {end_tokens}"
        )
    span = end_tokens - start_tokens

    def length_penalty(*, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [0.0 - min(1.0, max(0, len(ids) - start_tokens) / span) for ids in completion_ids]

    length_penalty.__doc__ = (
        f"0.0 up to {start_tokens} completion tokens, then "
        f"linearly down to -1.0 at {end_tokens} tokens and beyond."
    )
    return length_penalty


length_penalty = make_length_penalty(LENGTH_PENALTY_START_TOKENS, LENGTH_PENALTY_END_TOKENS)

BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "exact_match": exact_match,
    "format": format_reward,
    "math_equivalence": math_equivalence,
    "length_penalty": length_penalty,
    "code_exec": code_exec,
}
