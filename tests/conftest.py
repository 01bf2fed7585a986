"""Test-session setup shared by every test directory, and how the suite runs two test processes at
once.

The default run is parallel (setup.cfg's addopts: ``-n 2 --dist loadgroup``, pytest-xdist): two
worker processes take tests from one queue. A test that is not safe beside any other says so with
``@pytest.mark.xdist_group("name")``: the tests of one group run one after another on one worker.
Here every test that uses a module- or session-scoped fixture of its test file is put in its file's
group (unless it names a group of its own), so that fixture is still built once, not once per
worker; the tests that share one expensive run across files name a group of their own
(tests/test_resume.py's reference runs, tests/shared_runs.py's tiny recipe run).
``python -m pytest -n 0`` (or ``-p no:xdist``) runs the suite, or one test, in one process as
before. ``--cpu-times N`` reports the tests that used the most CPU (see below).
"""

import json
import os
import resource
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

# Two workers on a machine's cores: each worker, and every process it starts (tests/launch.py's
# clean_env copies this environment), computes on one thread, so two busy workers do not
# oversubscribe the cores. Set before torch is imported: its thread pool reads the variable when it
# starts. A value set in the environment wins.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 - after the thread count
import torch  # noqa: E402

# Without a GPU the Triton kernels run through Triton's interpreter (numpy on the CPU, slow but
# exact enough to compare against the references). Triton reads TRITON_INTERPRET when it is first
# imported, and conftest.py runs before any test module imports it; a value already set in the
# environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write tmp_path/<name>.py and put tmp_path on sys.path; the module is unloaded afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


# Module- and session-scoped fixtures cache what they build for the tests of their file: under
# pytest-xdist those tests must share a worker, or each worker would build the fixture again (a vLLM
# start, a reference run).
_SHARED_SCOPES = ("module", "package", "session")


def _file_fixture_shared(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture of wider than function scope defined in a test file (not a
    conftest's, nor one of pytest's own such as tmp_path_factory)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a test function (a doctest)
        return False
    return any(
        d.scope in _SHARED_SCOPES and d.baseid.endswith(".py")
        for defs in info.name2fixturedefs.values()
        for d in defs
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test that shares a file's fixture goes in its file's xdist_group (see the module
    docstring); and the slow tests that belong to no group come before the fast ones, so a worker
    does not start a minute-long test while the other has nothing left to do. pytest-xdist hands out
    whole groups first, the largest first; the order of the remaining tests is this collection order
    (the same in every worker), and nothing changes without xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _file_fixture_shared(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(
        key=lambda item: (
            item.get_closest_marker("xdist_group") is None
            and item.get_closest_marker("slow") is None
        )
    )  # stable: False (grouped or slow) first


# --cpu-times N: the CPU each test used, its own process's and its finished subprocesses' (getrusage
# RUSAGE_SELF and RUSAGE_CHILDREN around the test, fixtures it builds included): the suite's time on
# a busy 2-core machine is its CPU work, which --durations' wall times only hint at. Processes a
# test SIGKILLs with their whole group are not waited for by their own parents, so their CPU is
# missed. Each worker appends its rows to a file in the folder the controller names (CPU_TIMES_DIR,
# inherited by the workers it starts); the controller prints the table.
CPU_TIMES_DIR = "GRPO_DS_TEST_CPU_TIMES"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-times",
        type=int,
        default=None,
        metavar="N",
        help="after the run, the N tests that used the most CPU time, their subprocesses' included "
        "(0: every test)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--cpu-times") is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[CPU_TIMES_DIR] = tempfile.mkdtemp(prefix="grpo_ds-cpu-times-")


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its subprocesses that have ended and been
    waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    folder = os.environ.get(CPU_TIMES_DIR)
    before = _cpu_seconds() if folder else None  # without --cpu-times, nothing is measured
    yield
    if before is not None:
        own, children = (after - start for after, start in zip(_cpu_seconds(), before, strict=True))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"{worker}.jsonl", "a") as rows:
            rows.write(json.dumps({"test": item.nodeid, "own": own, "children": children}) + "\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    folder, count = os.environ.get(CPU_TIMES_DIR), config.getoption("--cpu-times")
    if not folder or count is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rows = [
        json.loads(line)
        for path in Path(folder).glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    shutil.rmtree(folder, ignore_errors=True)
    rows.sort(key=lambda row: -(row["own"] + row["children"]))
    total = sum(row["own"] + row["children"] for row in rows)
    terminalreporter.write_sep(
        "=", f"CPU seconds per test: {total:.0f} in all, over {len(rows)} tests"
    )
    terminalreporter.write_line(f"{'CPU s':>8} {'subproc.':>8}  test")
    for row in rows[: count or None]:
        terminalreporter.write_line(
            f"{row['own'] + row['children']:8.1f} {row['children']:8.1f}  {row['test']}"
        )
