"""grpo_ds.rewards.worker: a worker whose trainer is already gone when it starts (a stop at once
kills the workers while the trainer's pool may be starting a replacement) leaves quietly."""

import os
import subprocess
import sys

from tests.launch import clean_env


def test_a_worker_whose_trainer_is_gone_leaves_without_a_traceback():
    to_worker_r, to_worker_w = os.pipe()
    from_worker_r, from_worker_w = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-m", "grpo_ds.rewards.worker", str(to_worker_r), str(from_worker_w)],
        pass_fds=(to_worker_r, from_worker_w),
        env=clean_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    for fd in (to_worker_r, from_worker_w, to_worker_w, from_worker_r):
        os.close(fd)  # the trainer's ends closed: it is gone
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0 and err == "", err
