"""README.md stays the door: its two commands verbatim, at most 250 lines, its recipe valid, its
links present, and the shipped recipes load. The recipe reference lives in the docs
(tests/test_docs.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_ds.config.loading import load_recipe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_COMMAND = (
    "pip install torch==2.13.0 && pip install -e . && python -m grpo_ds.train recipes/tiny_cpu.json"
)
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'
MAX_LINES = 250


def _readme() -> str:
    return README.read_text(encoding="utf-8")


@pytest.mark.parametrize("command", [RUN_COMMAND, TEST_COMMAND])
def test_quickstart_commands_are_verbatim_in_their_own_code_blocks(command):
    assert f"```\n{command}\n```" in _readme()


def test_the_readme_fits_on_a_screen_or_five():
    assert len(_readme().splitlines()) <= MAX_LINES, (
        "the README is the door: the docs site holds the rest"
    )


def test_the_readme_recipe_is_a_valid_recipe():
    block = re.search(r"```json\n(.*?)\n```", _readme(), flags=re.DOTALL)
    assert block, "the README shows a recipe"
    recipe = load_recipe(json.loads(block.group(1)))
    assert recipe.model.path == "builtin:tiny"


def test_the_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _readme())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_ci_runs_the_readme_test_command():
    lines = [
        line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    ]
    assert TEST_COMMAND in lines, f".ci/run should run the README's test command: {TEST_COMMAND}"


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.json")), ids=lambda p: p.name)
def test_shipped_recipe_loads(recipe):
    # load_recipe checks keys, types, ranges and the batch algebra; it does not look for the model
    # or data, so GPU recipes pointing at /models/... load here too.
    loaded = load_recipe(recipe)
    assert loaded.samples_per_step % loaded.samples_per_optimizer_step == 0
