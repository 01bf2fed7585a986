"""README.md stays true to the code: every recipe key documented, the quickstart commands verbatim, recipes load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_ds.config.recipe import iter_fields, load_recipe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_COMMAND = "pip install torch==2.13.0 && pip install -e . && python -m grpo_ds.train recipes/tiny_cpu.json"
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'
REGENERATE = "regenerate the Recipe reference tables: python -m grpo_ds.config.reference"


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _schema_keys() -> list[str]:
    return [f"{section}.{f.name}" if section else f.name for section, f in iter_fields()]


def test_every_recipe_key_is_documented():
    text = _readme()
    missing = [key for key in _schema_keys() if f"`{key}`" not in text]
    assert not missing, f"README.md does not document {missing}; {REGENERATE}"


def test_reference_tables_name_only_existing_keys():
    reference = _readme().partition("## Recipe reference")[2]
    assert reference, "README.md has no '## Recipe reference' section"
    rows = re.findall(r"^\| `([A-Za-z_][\w.]*)` \|", reference, flags=re.MULTILINE)
    stale = sorted(set(rows) - set(_schema_keys()))
    assert rows and not stale, f"README.md documents keys the schema does not have: {stale}; {REGENERATE}"


@pytest.mark.parametrize("command", [RUN_COMMAND, TEST_COMMAND])
def test_quickstart_commands_are_verbatim_in_their_own_code_blocks(command):
    assert f"```\n{command}\n```" in _readme()


def test_ci_runs_the_readme_test_command():
    ci = ROOT / ".ci" / "run"
    if not ci.is_file():
        pytest.skip(".ci/run does not exist yet")
    lines = [line.strip() for line in ci.read_text(encoding="utf-8").splitlines()]
    assert TEST_COMMAND in lines, f".ci/run should run the README's test command: {TEST_COMMAND}"


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.json")), ids=lambda p: p.name)
def test_shipped_recipe_loads(recipe):
    # load_recipe checks keys, types, ranges and the batch algebra; it does not look for the model or data,
    # so GPU recipes pointing at /models/... load here too.
    loaded = load_recipe(recipe)
    assert loaded.samples_per_step % loaded.samples_per_optimizer_step == 0


def test_reference_tables_are_the_generated_ones():
    from grpo_ds.config.reference import tables

    assert tables() in _readme(), "README.md's recipe reference is stale: run python -m grpo_ds.config.reference"
