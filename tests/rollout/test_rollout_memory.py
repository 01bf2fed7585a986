"""Rollout memory does not grow with the completion length (issue 15, done-point 2).

The hf engine records each sampled token's log-prob one step at a time
(grpo_ds.rollout.hf.TokenSampler), so the rollout holds a fixed number of (samples, vocabulary)
score tensors whatever the completion length. Keeping every step's scores, as the engine did before,
holds 3 x steps of them at the end of generation (the scores generate returns, their log-softmaxes,
and the stacked copy).

Measured at a realistic vocabulary (151,936, Qwen2's) on a random Qwen2-architecture model with a
tiny hidden size, so that the scores dominate: the same 4 samples at 16 and at 64 new tokens, in a
fresh process whose glibc returns freed blocks above 128 KiB to the OS (MALLOC_MMAP_THRESHOLD_:
glibc's mallopt M_MMAP_THRESHOLD, which otherwise rises as large blocks are freed and keeps them on
the heap), the peak anonymous resident memory sampled in a thread during ``generate`` minus its
value just before. Run this file as a script to print the numbers.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

VOCAB = 151936
SAMPLES = (2, 2)  # prompts, completions per prompt
LENGTHS = (16, 64)
STEP_MIB = SAMPLES[0] * SAMPLES[1] * VOCAB * 4 / 2**20  # one step's float32 scores: 2.3 MiB
REPO = Path(__file__).resolve().parents[2]


def test_rollout_peak_memory_does_not_grow_with_the_completion_length():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(
        [sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peak = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    growth = peak[LENGTHS[1]] - peak[LENGTHS[0]]
    # 48 more steps: the all-steps path grew by 3 x 48 steps' scores (measured 108 -> 445 MiB); one
    # step at a time holds the same few steps' worth at both lengths (measured 11.6 MiB, within
    # 0.1 MiB). Growth of 4 steps' scores over 48 steps would mean something is kept per step, which
    # this bound refuses.
    assert growth < 4 * STEP_MIB, (
        f"peak extra MiB by completion length: {peak}; one step's scores: {STEP_MIB:.1f}"
    )
    # a bounded handful of steps' scores (measured: 5)
    assert peak[LENGTHS[1]] < 10 * STEP_MIB, peak


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))


def _peak_extra_mib(fn) -> float:
    """Peak RssAnon during fn() minus RssAnon just before, sampled every millisecond."""
    base = peak = _rss_anon_mib()
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss_anon_mib())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        stop.set()
        thread.join()
    return max(peak, _rss_anon_mib()) - base


def measure() -> dict[int, float]:
    """Peak extra RssAnon MiB of one hf-engine rollout per completion length (same prompts, samples
    and seed)."""
    import gc

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_ds.rollout.base import SamplingParams
    from grpo_ds.rollout.hf import HFRolloutEngine

    # tiny matrices: a second thread only waits, and it costs twice the time on a busy CPU
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    engine = HFRolloutEngine(
        Qwen2ForCausalLM(config), pad_token_id=0, eos_token_id=1, batch_prompts=SAMPLES[0]
    )
    prompts = [[5, 17, 923, 40000, 151000], [77, 3]]
    # first-call allocations, untimed
    engine.generate(prompts, SAMPLES[1], SamplingParams(max_new_tokens=4))
    peaks = {}
    for length in LENGTHS:
        gc.collect()
        out = None

        def rollout(length=length):
            nonlocal out
            out = engine.generate(
                prompts, SAMPLES[1], SamplingParams(max_new_tokens=length, seed=1)
            )

        peaks[length] = _peak_extra_mib(rollout)
        assert [len(r) for r in out.response_ids] == [length] * len(out), (
            "an EOS cut a completion short"
        )
    return peaks


if __name__ == "__main__":
    print(json.dumps(measure()))
