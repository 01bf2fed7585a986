"""Built-in reward functions, selected in a recipe by name (``{"name": "exact_match"}``).

Both follow the one reward signature (see ``grpo_ds.rewards``) and share one answer extraction:

1. if the text contains ``####`` (GSM8K style), the answer is everything after the last ``####``;
2. else if it contains ``\\boxed{...}`` (MATH style), the answer is the content of the last box
   (nested braces are matched);
3. else the answer is the whole text.

The extracted answer is then normalised: surrounding whitespace stripped, trailing periods removed
(``"7."`` -> ``"7"``), and thousands separators removed from numbers (``"1,000"`` -> ``"1000"``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_BOXED = "\\boxed{"


def extract_answer(text: str) -> str:
    """The final answer in ``text``: after the last ``####``, else the last ``\\boxed{}``, else all of it."""
    if "####" in text:
        return text.rsplit("####", 1)[1]
    start = text.rfind(_BOXED)
    if start >= 0:
        depth, begin = 1, start + len(_BOXED)
        for pos in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[begin:pos]
        return text[begin:]  # unclosed box (truncated completion): take what is there
    return text


def normalize_answer(text: str) -> str:
    """Strip whitespace and trailing periods; drop thousands separators from a number like ``1,000``."""
    s = text.strip()
    while s.endswith("."):
        s = s[:-1].rstrip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def parse_number(text: str) -> float | None:
    """The value of a normalised answer that is a plain decimal number, else None (``nan``/``inf`` are not)."""
    return float(text) if _NUMBER.fullmatch(text) else None


def answers_match(predicted: str, reference: str) -> bool:
    """Compare two raw texts after extraction and normalisation: numerically if both are numbers."""
    p, r = normalize_answer(extract_answer(predicted)), normalize_answer(extract_answer(reference))
    p_num, r_num = parse_number(p), parse_number(r)
    if p_num is not None and r_num is not None:
        return math.isclose(p_num, r_num, rel_tol=1e-9, abs_tol=1e-12)
    return p == r


def exact_match(*, completions: list[str], answer: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
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

    Precisely: the stripped completion is non-empty, and its extracted, normalised answer (same rules
    as ``exact_match``) is a plain decimal number. It does not compare with any reference and does not
    know whether generation was truncated.
    """
    return [
        float(bool(text.strip()) and parse_number(normalize_answer(extract_answer(text))) is not None)
        for text in completions
    ]


BUILTIN_REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "exact_match": exact_match,
    "format": format_reward,
}
