"""The memory timeline on a GPU: the CUDA allocated / reserved columns follow what a phase allocates
on the device, and the per-phase table gains its CUDA columns. Ran on an H200 on 2026-11-28."""

import pytest
import torch

from grpo_ds.step.memory_timeline import MIB, format_table, peaks_of, recording
from grpo_ds.step.profiling import Phase

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def test_a_phase_that_allocates_on_the_device_shows_in_the_cuda_columns(tmp_path):
    torch.cuda.synchronize()
    path = tmp_path / "rank0.memory.csv"
    with recording(path, interval_s=0.005, device=CUDA, step=1) as timeline:
        with Phase("rollout"):
            torch.ones(16, device=CUDA).sum().item()
        with Phase("update"):
            # 256 MiB, kept past the phase's end
            held = torch.empty(256 * MIB, dtype=torch.uint8, device=CUDA)
            held.fill_(1)
            torch.cuda.synchronize()
        rows = timeline.rows()
    update = next(p for p in peaks_of(rows) if p.phase == "update")
    rollout = next(p for p in peaks_of(rows) if p.phase == "rollout")
    assert update.peak_cuda_allocated - update.start_cuda_allocated >= 256 * MIB
    assert update.peak_cuda_reserved >= update.peak_cuda_allocated
    assert rollout.peak_cuda_allocated < update.peak_cuda_allocated
    assert all(r.cuda_allocated is not None and r.cuda_reserved is not None for r in rows)
    assert "peak CUDA allocated (MiB)" in format_table(peaks_of(rows))
    assert path.is_file()
    del held
