"""The leftovers of vLLM's CPU tensor parallelism in /dev/shm (grpo_ds/rollout/vllm_shm.py): a
segment no live process maps or holds open is removed; one that a process maps, or holds open,
stays. The segments here are files in the test's own folder (any file can be mapped), so that the
vLLM tests' clean-up beside it never sees them."""

import mmap
import subprocess
import sys
import time

from grpo_ds.rollout import vllm_shm


def test_only_segments_no_process_holds_are_removed(tmp_path):
    left, mapped, opened = (tmp_path / f"-tp:0-[0-1]-cpushm_{i}" for i in range(3))
    for path in (left, mapped, opened):
        path.write_bytes(b"\0" * 4096)
    with open(mapped, "r+b") as f:
        # mapped by this process, its file closed: as vLLM's SHMManager holds it
        view = mmap.mmap(f.fileno(), 4096)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(opened)!r}); import time; time.sleep(60)"]
    )
    try:
        deadline = time.monotonic() + 30
        while str(opened) not in vllm_shm.held_paths():  # until the child holds it open
            assert time.monotonic() < deadline, "the child never opened the file"
            time.sleep(0.05)
        assert vllm_shm.stale_segments(tmp_path) == [left]
        assert vllm_shm.remove_stale_segments(tmp_path) == [left]
        assert not left.exists() and mapped.exists() and opened.exists()
        view.close()
        holder.kill()
        holder.wait()
        assert vllm_shm.remove_stale_segments(tmp_path) == sorted([mapped, opened])
    finally:
        holder.kill()
