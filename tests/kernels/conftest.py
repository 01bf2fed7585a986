"""Fixtures of the kernel tests: the backends to compare against grpo_ds/algo, on the CPU.

On the CPU the Triton backend runs through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 there); without Triton installed, or where it cannot run, its tests skip and the
torch path is still tested.
"""

import pytest

from grpo_ds.config.software import triton_problem


def skip_unless_triton(device_type: str = "cpu") -> None:
    """Skip the calling test when the Triton backend cannot run on ``device_type``."""
    pytest.importorskip("triton")
    problem = triton_problem(device_type)
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> str:
    """Each backend in turn: the chunked PyTorch path and the Triton kernels."""
    if request.param == "triton":
        skip_unless_triton()
    return request.param


@pytest.fixture
def triton_backend() -> str:
    """The Triton backend alone, for behaviour only it has."""
    skip_unless_triton()
    return "triton"
