"""Packed vs padded micro-batches: the update's time and peak memory on completions of very
different lengths.

    python benchmarks/bench_packing.py [--runs 3] [--record]

One optimizer step of grpo_ds.step.update.optimizer_step on a ZeRO-3 engine (world size 1, CPU),
over fixed rollouts whose completions vary in length the way reasoning RL's do (log-normal, 8 to
512 tokens, after 32-token prompts), cut into micro-batches of 16 samples: padded, every row is as
long as its micro-batch's longest sequence; packed (train.packing), the sequences are concatenated
into one row. The same samples land in the same micro-batches either way, so the two compute the
same update (tests/step/test_update.py checks that); the difference is the padding. Each variant
runs in its own process (glibc's mmap threshold pinned, so freed memory returns to the OS), the two
alternating --runs times: time is the median step, memory the peak anonymous resident set above what
the process held once the engine was built. Targets: packed >= 1.3x faster, with a lower peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

SHAPE = dict(
    vocab_size=8_192,
    hidden_size=512,
    intermediate_size=1_408,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=1_024,
)
SAMPLES, MICRO, PROMPT = 32, 16, 32


def rollouts():
    import torch

    from grpo_ds.rollout.base import Rollouts

    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(SAMPLES, generator=g) * 1.0 + 4.2).clamp(8, 512).long().tolist()
    prompts = [torch.randint(5, 1000, (PROMPT,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]
    advantages = torch.randn(SAMPLES, generator=g).tolist()
    return Rollouts(
        prompts, responses, [[0.0] * n for n in lengths], ["length"] * SAMPLES
    ), advantages


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))


def variant(packed: bool, steps: int, out: str) -> None:
    """One process: build the engine, run ``steps`` optimizer steps; write the step times and the
    peak."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_ds.config.deepspeed import resolve_deepspeed_config
    from grpo_ds.config.loading import load_recipe
    from grpo_ds.distributed.ranks import init_distributed
    from grpo_ds.model.engine import create_train_engine
    from grpo_ds.step.batch import StepBatch
    from grpo_ds.step.plan import plan_minibatch
    from grpo_ds.step.update import UpdateSettings, optimizer_step

    dist = init_distributed()
    torch.manual_seed(0)
    recipe = load_recipe(
        {
            "rollout": {"prompts_per_step": 4, "group_size": 8},
            "train": {"micro_batch_samples_per_gpu": MICRO, "lr": 1e-5, "packing": packed},
        }
    )
    engine = create_train_engine(
        LlamaForCausalLM(LlamaConfig(**SHAPE)), resolve_deepspeed_config(recipe, 1, "cpu")
    )
    data, advantages = rollouts()
    tokens = {
        i: len(p) + len(r)
        for i, (p, r) in enumerate(zip(data.prompt_ids, data.response_ids, strict=True))
    }
    plan = plan_minibatch(list(tokens), tokens, 1, max_samples=MICRO, packed=packed)
    settings = UpdateSettings.from_recipe(recipe, pad_id=0, backend="torch", packing_allowed=packed)
    step = StepBatch([], data, [], advantages=advantages)
    optimizer_step(engine, step, plan, settings, dist)  # warm-up (and the optimizer's states)
    base, peak = rss_anon_mib(), [0.0]

    def sample():
        while True:
            peak[0] = max(peak[0], rss_anon_mib())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        optimizer_step(engine, step, plan, settings, dist)
        times.append(time.perf_counter() - t)
    from grpo_ds.step.micro_batch import collate

    positions = sum(
        collate(data, list(mb), 0, torch.device("cpu"), packed=packed).input_ids.numel()
        for mb in plan.micro_batches[0]
    )  # what the model computes: tokens and padding
    Path(out).write_text(
        json.dumps(
            {
                "times": times,
                "peak_mib": peak[0] - base,
                "real": sum(tokens.values()),
                "positions": positions,
            }
        )
    )


def main() -> None:
    from common import markdown_table, report

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per variant")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run")
    parser.add_argument("--workdir", default="/tmp/grpo_ds_bench_packing")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument("--variant", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        variant(args.variant[0] == "packed", args.steps, args.variant[1])
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    from tests.launch import clean_env

    env = {**clean_env(), "MALLOC_MMAP_THRESHOLD_": "131072"}
    results: dict[str, list[dict]] = {"padded": [], "packed": []}
    for run in range(args.runs):
        for name in ("padded", "packed"):
            out = workdir / f"{name}{run}.json"
            subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--variant", name, str(out)],
                cwd=REPO,
                env=env,
                check=True,
                capture_output=True,
            )
            results[name].append(json.loads(out.read_text()))
            print(
                name,
                run,
                results[name][-1]["times"],
                round(results[name][-1]["peak_mib"]),
                flush=True,
            )
    first = results["padded"][0]
    padding = 1 - first["real"] / first["positions"]
    rows, medians, peaks = [], {}, {}
    for name, runs in results.items():
        medians[name] = statistics.median(t for r in runs for t in r["times"])
        peaks[name] = statistics.median(r["peak_mib"] for r in runs)
        every = [t for r in runs for t in r["times"]]
        rows.append(
            [
                name,
                f"{runs[0]['positions']:,}",
                f"{medians[name]:.2f}",
                f"{min(every):.2f}",
                f"{max(every):.2f}",
                f"{peaks[name]:,.0f}",
            ]
        )
    speedup = medians["padded"] / medians["packed"]
    headers = [
        "layout",
        "model positions per step (tokens + padding)",
        "step s (median)",
        "min",
        "max",
        "peak MiB (median)",
    ]
    body = markdown_table(headers, rows)
    notes = [
        f"workload: {SAMPLES} samples, {PROMPT}-token prompts, completions log-normal in [8, 512] "
        f"tokens, micro-batches of {MICRO}; padding is "
        f"{100 * padding:.0f}% of the padded layout's tokens",
        f"model: random Llama, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
        f"vocabulary {SHAPE['vocab_size']:,}, float32, ZeRO-3, world size 1, fused lm_head, sdpa",
        f"packed is {speedup:.2f}x faster (target 1.3x): {'met' if speedup >= 1.3 else 'NOT met'}; "
        f"peak memory {peaks['packed'] / peaks['padded']:.2f}x the padded one's (target below 1): "
        f"{'met' if peaks['packed'] < peaks['padded'] else 'NOT met'}",
        f"{args.runs} alternating runs per layout, {args.steps} timed optimizer steps each, each "
        "run in a fresh process",
    ]
    report(
        "Packed vs padded micro-batches",
        f"{SAMPLES} samples, {100 * padding:.0f}% padding",
        "cpu",
        body,
        notes,
        args.record,
    )


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
