"""notebooks/quickstart.ipynb: committed without outputs, and runs end to end from its own folder.

The slow test executes the notebook with nbclient in a fresh python3 kernel whose working directory
is notebooks/, as a user opening it in Jupyter would, then reads the results back through one extra
cell appended in memory (the committed notebook is not changed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
MARKER = "GRPO_DS_NOTEBOOK_RESULT "
# Appended to the executed copy: report what the notebook computed as one JSON line.
REPORT_CELL = (
    "import json as _json\n"
    f"print({MARKER!r} + _json.dumps({{'last10': last10, "
    "'steps': len(metrics), 'run_dir': str(run_dir)}))"
)


def _read_notebook():
    nbformat = pytest.importorskip("nbformat")
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_committed_without_outputs():
    nb = _read_notebook()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the quickstart notebook has no code cells"
    dirty = [
        i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count") is not None
    ]
    assert not dirty, (
        f"code cells {dirty} carry outputs; clear them (jupyter nbconvert --clear-output --inplace)"
    )
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.slow
def test_notebook_trains_tiny_recipe_from_its_folder(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = _read_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL))
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    # One intra-op thread: the tiny model's ops are too small to gain from two, and on a CPU shared
    # with other processes two spinning OpenMP threads per process slow each step ~50x (0.13 s ->
    # 6 s measured). TMPDIR: the notebook's tempfile.mkdtemp() output folder lands in pytest's
    # tmp_path, cleaned up by pytest.
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})

    lines = [
        line
        for output in nb.cells[-1].outputs
        if output.get("output_type") == "stream"
        for line in output.get("text", "").splitlines()
        if line.startswith(MARKER)
    ]
    assert len(lines) == 1, f"report cell printed no result: {nb.cells[-1].outputs}"
    result = json.loads(lines[0].removeprefix(MARKER))
    assert result["steps"] == 260, "the notebook should run the whole tiny recipe"
    printed = "".join(
        o.get("text", "") for o in nb.cells[-2].outputs if o.get("output_type") == "stream"
    )
    assert "mean reward of the last 10 steps" in printed
    run_dir = Path(result["run_dir"])
    assert run_dir.is_relative_to(tmp_path), (
        f"the run folder {run_dir} should be under the notebook's temp dir"
    )
    assert (run_dir / "metrics.jsonl").is_file()
    assert (run_dir / "reward.png").is_file(), (
        "the plot cell should save reward.png into the run folder"
    )
    assert result["last10"] >= 0.9, (
        f"tiny recipe did not learn: last-10-step mean reward {result['last10']:.3f}"
    )
