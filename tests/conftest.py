"""Test-session setup shared by every test directory."""

import os
import sys
import textwrap

import pytest
import torch

# Without a GPU the Triton kernels run through Triton's interpreter (numpy on the CPU, slow but exact enough to
# compare against the references). Triton reads TRITON_INTERPRET when it is first imported, and conftest.py
# runs before any test module imports it; a value already set in the environment wins.
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
