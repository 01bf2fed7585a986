"""The docs site stays true to the code: it builds with --strict, its generated pages and transcripts are fresh,
every recipe key is in the reference, and no module cites a file outside the repository."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_ds.config.recipe import iter_fields

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference" / "recipe.md"
REGENERATE = "regenerate the generated pages: python docs/generate.py"


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema_keys() -> list[str]:
    return [f"{section}.{f.name}" if section else f.name for section, f in iter_fields()]


def test_every_recipe_key_is_in_the_reference():
    text = REFERENCE.read_text(encoding="utf-8")
    missing = [key for key in _schema_keys() if f"| `{key}` |" not in text]
    assert not missing, f"docs/reference/recipe.md does not document {missing}; {REGENERATE}"


def test_the_reference_names_only_existing_keys():
    rows = re.findall(r"^\| `([A-Za-z_][\w.]*)` \|", REFERENCE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    stale = sorted(set(rows) - set(_schema_keys()))
    assert rows and not stale, f"docs/reference/recipe.md documents keys the schema does not have: {stale}"


def test_generated_pages_are_fresh():
    """The recipe reference, the command-line reference and the benchmarks page are what the code gives now."""
    assert not (stale := _generate().stale(transcripts=False)), f"stale: {stale}; {REGENERATE}"


@pytest.mark.slow
def test_transcripts_are_the_consoles_of_real_runs():
    """Each console shown in the docs is run again (the tiny recipe, the dry run, bad input, a preempted run and its
    resume) and compared with the committed transcript, timings and versions masked."""
    generate = _generate()
    for name, make in generate.TRANSCRIPTS.items():
        committed = generate.transcript_path(name).read_text()
        fresh = make(generate._scratch())
        assert generate.mask(committed) == generate.mask(fresh), \
            f"docs/transcripts/{name}.txt is stale; run: python docs/generate.py --transcripts\n{fresh}"


def test_masking_hides_only_what_differs_between_runs():
    mask = _generate().mask
    assert mask("step    1 reward_mean=0.1 tokens_per_s=5478 time_step_s=0.93") == \
        mask("step    1 reward_mean=0.1 tokens_per_s=12 time_step_s=7.1")
    assert mask("step    1 reward_mean=0.1") != mask("step    1 reward_mean=0.2")  # a changed number is stale
    assert mask("step    1 reward_mean=0.1") != mask("step    1 reward_std=0.1")  # so is a changed key
    assert mask("step   25 reward_mean=0.1") != mask("step   25 reward_std=0.1")
    # later steps follow the rounding of MKL's per-CPU code path (a Xeon's and an EPYC's part after ~100 tiny steps)
    assert mask("step  125 reward_mean=0.6737 loss=-0.002309") == mask("step  125 reward_mean=0.6875 loss=-0.001394")
    assert mask("step   10 reward_mean=0.1") == mask("step   10 reward_mean=0.2")
    assert mask("  torch         2.13.0+cpu (CPU build)") == mask("  torch         2.14.1+cu130")
    assert mask("preempted: stopped by SIGTERM after step 3 of 60") == mask("preempted: stopped by SIGTERM after "
                                                                            "step 2 of 60")


def test_the_docs_build_with_strict(tmp_path):
    """mkdocs build --strict: a broken link, a missing anchor, a snippet that is not there or a docstring that does
    not render fails the build."""
    pytest.importorskip("mkdocs")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_no_file_cites_a_document_outside_the_repository():
    """The project's own docs hold its design; nothing points a reader at a file they do not have."""
    outside = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|shared/notes")
    found = []
    for folder in ("grpo_ds", "tests", "benchmarks", "docs", "recipes", "notebooks"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md", ".json", ".ipynb", ".sh", ".txt", ".yml") \
                    and path != Path(__file__).resolve():
                found += [f"{path.relative_to(ROOT)}:{n}" for n, line in
                          enumerate(path.read_text(errors="ignore").splitlines(), 1) if outside.search(line)]
    found += [f"README.md:{n}" for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
              if outside.search(line)]
    assert not found, f"cites a file outside the repository: {found}"
