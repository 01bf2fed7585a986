"""The one exception type for bad user input, and the CLI's way of reporting it.

Every problem a user can fix (recipe, override, data row, model path, DeepSpeed file, reward
function) is raised as ``UserError(where, what, fix)`` and printed as one line
``error: <where>: <what>. <fix>`` on stderr with exit code 2 and no traceback.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from grpo_ds.distributed import launcher

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input: says where it is, what is wrong and how to fix it."""

    def __init__(self, where: str, what: str, fix: str = "") -> None:
        self.where, self.what, self.fix = where, what.rstrip("."), fix.rstrip(".")
        super().__init__(str(self))

    def __reduce__(self):  # picklable, so rank 0 can send it to the other ranks
        return (UserError, (self.where, self.what, self.fix))

    def __str__(self) -> str:
        fix = self.fix + ("" if self.fix.endswith(("?", "!")) else ".")
        return f"{self.where}: {self.what}." + (f" {fix}" if self.fix else "")


class Relayed(UserError):
    """A refusal another rank made and printed, raised again on this one (which does not print it a
    second time): split placement's sides tell each other theirs before training."""

    def __reduce__(self):  # stays a Relayed when rank 0 sends it to the other ranks
        return (Relayed, (self.where, self.what, self.fix))


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (library errors can run to pages), for a one-line
    UserError."""
    lines = str(err).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(err).__name__


def suggest(name: str, options: Iterable[str], label: str = "valid keys") -> str:
    """The fix for a misspelt name: the closest option ("did you mean 'x'?"), else every option
    after ``label``."""
    options = list(options)
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"{label}: " + ", ".join(options)


def json_type_name(value: Any) -> str:
    """How a message names the JSON type of ``value``: "a string", "an object", "null"."""
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a UserError into the one-line message and exit code 2 (for command-line entry
    points)."""
    try:
        yield
    except UserError as err:
        if not isinstance(err, Relayed):  # another rank has printed a relayed one
            launcher.say(f"error: {err}")  # every rank raises the same error; one line is enough
        sys.exit(EXIT_USER_ERROR)
