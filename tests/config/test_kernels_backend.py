"""grpo_ds.config.software.resolve_backend: which backend a run gets, and why "triton" is refused
where it cannot run."""

import pytest

from grpo_ds.config.software import resolve_backend


def test_torch_is_always_torch():
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("torch", "cuda") == "torch"


def test_auto_on_cpu_is_torch():
    # Even with TRITON_INTERPRET=1 (set for this test session): the interpreter is for tests, not
    # training.
    assert resolve_backend("auto", "cpu") == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need a CUDA GPU.*cpu.*TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"


def test_triton_needs_triton_installed(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)
    with pytest.raises(ValueError, match="Triton is not installed"):
        resolve_backend("triton", "cuda")
    assert resolve_backend("auto", "cuda") == "torch"


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown kernels backend 'cuda'.*auto, triton, torch"):
        resolve_backend("cuda", "cuda")
