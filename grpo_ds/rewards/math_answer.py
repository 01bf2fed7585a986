"""Built-in reward ``math_equivalence``: is the completion's final answer the same number (or text)
as the reference?

Extraction, with the precedence every built-in shares (``grpo_ds.rewards.final_answer``). From the
completion: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``; nested braces are
matched); else the first line after the last ``####`` (GSM8K style; if that line is not a number,
the first number in it); else the last number anywhere in the text (``-3``, ``1,000``, ``2.5``,
``.5``, ``3/4``, ``\\frac{3}{4}``). A completion with none of these has no answer and scores 0.0.
The reference (the dataset's answer column) goes through the first two steps, else is taken whole,
so ``"... #### 72"`` and ``"72"`` both work.

Normalisation (both sides). Math delimiters (``$``, ``\\(``, ``\\[``), ``\\left``/``\\right``, LaTeX
spaces (``\\!``, ``\\,``, ``\\;``, ``\\quad``), ``\\displaystyle``, dollar signs, percent signs,
degree marks (``^\\circ``), a trailing period, a leading ``x =``, and all whitespace are removed;
``\\dfrac``/``\\tfrac`` become ``\\frac``; thousands separators (``1,000``, ``1{,}000``) go when the
answer is a number. Text groups (``\\text{...}``, ``\\mbox{...}``, ``\\mathrm{...}``) are units when
what is left is a number (``5\\text{ cm}`` is 5), and are unwrapped otherwise (``\\text{(A)}`` is
``(A)``).

Comparison. When both answers are numbers — an integer, a decimal (with an optional exponent),
``a/b`` or ``\\frac{a}{b}`` (``\\frac12`` too), at most 10**1000 in size — they are compared exactly
as rationals (``fractions.Fraction``), never with a float tolerance:
``0.5 == .50 == 1/2 == \\frac{1}{2}``, but ``0.333 != 1/3``. Otherwise the normalised strings must
be equal (case matters).

Decisions worth knowing: the percent sign is dropped, not divided by 100, so ``50\\%`` equals ``50``
but not ``0.5`` (math datasets write the reference as ``50`` for "what percent" questions). Mixed
numbers (``2\\frac{1}{2}``), ``\\sqrt``, ``\\pi`` and other expressions are compared as strings, not
evaluated.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from grpo_ds.rewards.final_answer import extract_answer, marked_answer

# numbers beyond 10**1000 (or below 10**-1000 in size) are not parsed as numbers
_MAX_EXPONENT = 1000
_PLAIN = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_PLAIN_RE = re.compile(_PLAIN)
_SLASH_RE = re.compile(rf"({_PLAIN})/({_PLAIN})")
_FRAC_ARG = r"(\{[^{}]*\}|\d)"  # \frac{12}{5} or \frac12 (one-digit arguments need no braces)
_FRAC_RE = re.compile(rf"([+-]?)\\frac{_FRAC_ARG}{_FRAC_ARG}")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# Candidates for "the last number in the text": a LaTeX fraction, or a number (thousands separators,
# decimals, an a/b fraction). A minus sign counts only when it does not follow a word character
# ("10-5" ends in 5).
_NUMBER_IN_TEXT = re.compile(
    r"-?\\[dt]?frac(?:\{[^{}]*\}|\d)(?:\{[^{}]*\}|\d)"
    r"|(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"
    r"|(?<![\w.])-?\.\d+"
)
_TEXT_GROUP = re.compile(r"\\(?:text|textrm|textbf|textit|mbox|mathrm|mathbf)\s*\{([^{}]*)\}")
_REMOVE = [
    re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])"),
    re.compile(r"\\displaystyle|\\q?quad(?![a-zA-Z])|\\[!,;: ]|~"),
    re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree"),
    re.compile(r"\\?\$|\\?%"),
]


def extract_final_answer(completion: str) -> str | None:
    """The completion's final answer: its marked answer (``grpo_ds.rewards.final_answer``), of a
    ``####`` answer the first line (or the first number on it when that line is not a number); else
    the last number in the text; None if there is none."""
    marked = marked_answer(completion)
    if marked is None:
        found = list(_NUMBER_IN_TEXT.finditer(completion.replace("\u2212", "-")))
        return found[-1].group(0) if found else None
    if marked.marker == "boxed":
        return marked.text
    lines = [line for line in marked.text.splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[0]
    if to_number(normalize(line)) is None:
        found = _NUMBER_IN_TEXT.search(line.replace("\u2212", "-"))
        return found.group(0) if found else line
    return line


def normalize(answer: str) -> str:
    """The answer with presentation stripped (see the module docstring); numbers keep their written
    form."""
    s = answer.strip().replace("\u2212", "-")
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip())
    for pattern in _REMOVE:
        s = pattern.sub("", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("{,}", ",")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"^[a-zA-Z]\w*=(?=[^=]+$)", "", s)  # "x=5" -> "5" (one "=" only)
    units_dropped = _TEXT_GROUP.sub("", s)
    if units_dropped != s and to_number(_drop_thousands(units_dropped)) is not None:
        return _drop_thousands(units_dropped)
    return _drop_thousands(_TEXT_GROUP.sub(r"\1", s))


def _drop_thousands(s: str) -> str:
    return s.replace(",", "") if _THOUSANDS_RE.fullmatch(s) else s


def to_number(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number (int, decimal, a/b, \\frac{a}{b}),
    else None."""
    if _PLAIN_RE.fullmatch(normalized):
        return _plain(normalized)
    slash = _SLASH_RE.fullmatch(normalized)
    if slash:
        return _ratio(_plain(slash.group(1)), _plain(slash.group(2)))
    frac = _FRAC_RE.fullmatch(normalized)
    if frac:
        sign, num, den = frac.group(1), frac.group(2).strip("{}"), frac.group(3).strip("{}")
        if not (_PLAIN_RE.fullmatch(num) and _PLAIN_RE.fullmatch(den)):
            return None
        value = _ratio(_plain(num), _plain(den))
        return -value if value is not None and sign == "-" else value
    return None


def _plain(s: str) -> Fraction | None:
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    # 1e999999999999 is a few bytes of text but an integer too large to build: no answer is that
    # big.
    if abs(value.adjusted()) > _MAX_EXPONENT:
        return None
    return Fraction(value)


def _ratio(num: Fraction | None, den: Fraction | None) -> Fraction | None:
    return None if num is None or den is None or den == 0 else num / den


def answers_equivalent(completion: str, reference: str) -> bool:
    """Whether the completion's final answer equals the reference answer (rules in the module
    docstring)."""
    found = extract_final_answer(completion)
    if found is None:
        return False
    predicted, expected = normalize(found), normalize(extract_answer(reference))
    if not predicted:
        return False
    p_num, r_num = to_number(predicted), to_number(expected)
    if p_num is not None and r_num is not None:
        return p_num == r_num
    return predicted == expected


def math_equivalence(
    *, completions: list[str], answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically the ``answer`` column's, else 0.0.

    A sample whose reference is None gets None (no score). The rules are in this module's docstring.
    """
    if answer is None:
        raise ValueError(
            "math_equivalence needs a dataset column named 'answer' (set data.answer_key to the "
            "column holding reference answers)"
        )
    return [
        None if ref is None else float(answers_equivalent(text, str(ref)))
        for text, ref in zip(completions, answer, strict=True)
    ]
