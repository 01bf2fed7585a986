"""Runs that several slow tests read, made once per test session (each launch costs ~10 s of imports
alone).

``tiny_recipe_run()``: the README's command, ``python -m grpo_ds.train recipes/tiny_cpu.json`` (all
260 steps), run as docs/generate.py runs it for docs/transcripts/train_tiny.txt (from a scratch
folder holding recipes/ and ds_configs/, stdout and stderr interleaved). tests/test_docs.py compares
its console with the committed transcript; tests/test_train.py checks that it learned, what it wrote
to disk and that its console is a log.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def docs_generate():
    """docs/generate.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class CommandRun:
    args: list[str]  # after `python`
    cwd: Path
    returncode: int
    output: str  # raw stdout and stderr, interleaved as a terminal shows them

    def transcript(self, expect: int | None = None) -> str:
        """The console as docs/transcripts/ hold it (docs/generate.py's own rendering)."""
        return docs_generate().transcript(self.args, self.returncode, self.output, expect=expect)


@functools.cache
def tiny_recipe_run() -> CommandRun:
    generate = docs_generate()
    cwd = generate._scratch()
    atexit.register(shutil.rmtree, cwd, ignore_errors=True)
    returncode, output = generate.run_raw(generate.TRAIN_TINY, cwd)
    return CommandRun(list(generate.TRAIN_TINY), cwd, returncode, output)
