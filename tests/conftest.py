"""Test-session setup shared by every test directory."""

import os

import torch

# Without a GPU the Triton kernels run through Triton's interpreter (numpy on the CPU, slow but exact enough to
# compare against the references). Triton reads TRITON_INTERPRET when it is first imported, and conftest.py
# runs before any test module imports it; a value already set in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
