"""notebooks/quickstart.ipynb: committed without outputs, and runs end to end from its own folder.

The slow test executes the notebook with nbclient in a fresh python3 kernel whose working directory is
notebooks/, as a user opening it in Jupyter would, then reads the results back through one extra cell
appended in memory (the committed notebook is not changed).

Its training call is the README's run of the tiny recipe, which tests/shared_runs.py makes once for the test session
(tests/test_train.py checks that it learns): a cell prepended in memory records the notebook's ``grpo_ds.train`` call,
runs it for real for 2 steps (its run folder, plot and printout are the notebook's own) and hands the notebook the
shared run's 260 steps of metrics. The test checks that the call is the tiny recipe with nothing that changes its
training (only the output folder and the progress bar), so the shared run is the run the notebook would make.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.shared_runs import REPO, tiny_recipe_run

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
MARKER = "GRPO_DS_NOTEBOOK_RESULT "
# Appended to the executed copy: report what the notebook computed as one JSON line.
REPORT_CELL = (
    "import json as _json\n"
    f"print({MARKER!r} + _json.dumps({{'last10': last10, 'steps': len(metrics), 'run_dir': str(run_dir), "
    "'calls': _grpo_ds_calls}))"
)
# Prepended: grpo_ds.train records its call, trains 2 steps of it for real, and returns the shared run's metrics.
SHARED_TRAIN_CELL = """
import json as _json
import grpo_ds
import grpo_ds.train as _train_module  # imported first: importing it later would set grpo_ds.train back

_grpo_ds_calls = []


def _shared_train(recipe, overrides=None):
    _grpo_ds_calls.append([str(recipe), dict(overrides or {})])
    _train_module.run(recipe, {**(overrides or {}), "train.steps": 2})
    with open(METRICS_FILE) as _file:
        return [_json.loads(_line) for _line in _file]


grpo_ds.train = _shared_train
"""


def _read_notebook():
    nbformat = pytest.importorskip("nbformat")
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_committed_without_outputs():
    nb = _read_notebook()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the quickstart notebook has no code cells"
    dirty = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count") is not None]
    assert not dirty, f"code cells {dirty} carry outputs; clear them (jupyter nbconvert --clear-output --inplace)"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.slow
def test_notebook_trains_tiny_recipe_from_its_folder(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    shared = tiny_recipe_run()
    assert shared.returncode == 0, shared.output[-4000:]
    nb = _read_notebook()
    metrics_file = shared.cwd / "runs" / "tiny_cpu" / "metrics.jsonl"
    nb.cells.insert(0, nbformat.v4.new_code_cell(SHARED_TRAIN_CELL.replace("METRICS_FILE", repr(str(metrics_file)))))
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    # One intra-op thread: the tiny model's ops are too small to gain from two, and on a CPU shared with other
    # processes two spinning OpenMP threads per process slow each step ~50x (0.13 s -> 6 s measured).
    # TMPDIR: the notebook's tempfile.mkdtemp() output folder lands in pytest's tmp_path, cleaned up by pytest.
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
    # the notebook trains the tiny recipe as shipped (the shared run's command): its own output folder, no bar
    ((recipe, overrides),) = result["calls"]
    assert Path(recipe) == REPO / "recipes" / "tiny_cpu.json"
    assert set(overrides) == {"run.output_dir", "logging.progress_bar"} and overrides["logging.progress_bar"] is False
    assert result["steps"] == 260, "the notebook should run the whole tiny recipe"
    printed = "".join(o.get("text", "") for o in nb.cells[-2].outputs if o.get("output_type") == "stream")
    assert "mean reward of the last 10 steps" in printed
    run_dir = Path(result["run_dir"])
    assert run_dir.is_relative_to(tmp_path), f"the run folder {run_dir} should be under the notebook's temp dir"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2  # the notebook's call trained (2 steps)
    assert (run_dir / "reward.png").is_file(), "the plot cell should save reward.png into the run folder"
    assert result["last10"] >= 0.9, f"tiny recipe did not learn: last-10-step mean reward {result['last10']:.3f}"
