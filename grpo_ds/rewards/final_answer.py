"""Where a text states its final answer: the one extraction rule of the built-in rewards that read
answers (``exact_match``, ``format`` and ``math_equivalence``), applied to completions and reference
answers alike.

Precedence:

1. the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``; nested braces are matched, an
   unclosed box, as in a truncated completion, gives what follows it, and ``\\boxed 5`` gives
   ``5``);
2. else everything after the last ``####`` (GSM8K style);
3. else the text marks no answer: ``marked_answer`` is None and ``extract_answer`` takes the whole
   text (``math_equivalence`` takes a completion's last number instead).

A box comes first because it is explicit: MATH-style solutions box exactly the answer, while
``####`` only says where the answer starts, so ``"#### 3, or rather \\boxed{4}"`` answers 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass(frozen=True)
class MarkedAnswer:
    text: str  # the box's content, or everything after the last "####" (unstripped)
    marker: Literal["boxed", "####"]


def marked_answer(text: str) -> MarkedAnswer | None:
    """The answer ``text`` marks as final (precedence in the module docstring), or None when it
    marks none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return MarkedAnswer(boxed, "boxed")
    if "####" in text:
        return MarkedAnswer(text.rsplit("####", 1)[1], "####")
    return None


def extract_answer(text: str) -> str:
    """The final answer in ``text``: its marked answer, else all of it (how every reference answer
    is read)."""
    marked = marked_answer(text)
    return text if marked is None else marked.text


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox``) in ``text``, braces matched; None if
    there is none.

    An unclosed box (a truncated completion) gives what follows it; ``\\boxed 5`` gives ``5``.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    head = text[start:]
    after = head[len(next(cmd for cmd in _BOX_COMMANDS if head.startswith(cmd))) :].lstrip()
    if not after.startswith("{"):
        token = after.split()
        return token[0].rstrip("$.") if token else None
    body = after[1:]
    depth = 1
    for pos, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return body[:pos]
    return body
