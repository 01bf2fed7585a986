"""The code's form is ruff's: `ruff check` (the rules and the 100-column line length in ruff.toml)
and `ruff format --check` pass on the whole repository. The one commit that reflowed the code to 100
columns is listed in .git-blame-ignore-revs, so `git blame` skips it
(`git config blame.ignoreRevsFile .git-blame-ignore-revs`)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_COLUMNS = 100


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_the_configured_line_length_is_at_most_100():
    length = re.search(r"^line-length\s*=\s*(\d+)", (REPO / "ruff.toml").read_text(), re.M)
    assert length and int(length.group(1)) <= MAX_COLUMNS


@pytest.mark.parametrize(
    "command", [("check", "."), ("format", "--check", ".")], ids=["check", "format"]
)
def test_ruff_passes(command):
    done = _ruff(*command)
    assert done.returncode == 0, (
        f"ruff {' '.join(command)}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    )


def test_the_reflow_commit_is_ignored_by_blame():
    revs = [
        line.split()[0]
        for line in (REPO / ".git-blame-ignore-revs").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert revs and all(re.fullmatch(r"[0-9a-f]{40}", rev) for rev in revs), revs
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True
    )
    # a full clone holds every commit
    if shallow.returncode == 0 and shallow.stdout.strip() == "false":
        for rev in revs:
            kind = subprocess.run(
                ["git", "cat-file", "-t", rev], cwd=REPO, capture_output=True, text=True
            )
            assert kind.stdout.strip() == "commit", f"{rev} is not a commit of this repository"
