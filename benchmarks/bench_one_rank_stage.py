"""One rank: ZeRO stage 1 (what grpo_ds runs) against ZeRO stage 3 (train.zero3_on_one_rank), on a
whole recipe.

    python benchmarks/bench_one_rank_stage.py [--recipe recipes/tiny_cpu.json] [--steps 100] [--runs
        3] [--record]

A one-rank run of a stage-3 DeepSpeed file without offload trains with stage 1
(grpo_ds.config.deepspeed.one_rank_stage): one rank has nothing to partition, and ZeRO-3 still
gathers and releases every module's parameters around each forward and backward. This runs the
recipe --steps steps both ways, each run a fresh process (as ``python -m grpo_ds.train``),
alternating --runs times, and reports per variant the median of the per-step phase times (time_*_s,
the first 5 steps left out as warm-up), the peak resident memory (VmHWM), and how far the two
variants' metrics are apart over the first 5 steps (the same update up to float32 rounding: the runs
then drift apart like any two runs whose sums are ordered differently). At two or more ranks nothing
changes (ZeRO-3 runs as the file says), so there the stage costs nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

VARIANTS = {"stage 1 (default)": False, "stage 3 (train.zero3_on_one_rank)": True}
PHASES = ("step", "rollout", "reward", "update", "sync")
COMPARED = ("reward_mean", "loss", "grad_norm", "entropy")
WARMUP = 5


def child(recipe: str, steps: int, zero3: bool, out_dir: str, result: str) -> None:
    """One training run in this process; its metrics and peak memory into ``result``."""
    from grpo_ds.train import run

    history = run(
        recipe,
        {
            "train.steps": steps,
            "train.zero3_on_one_rank": zero3,
            "run.output_dir": out_dir,
            "run.overwrite": True,
            "checkpoint.every_steps": None,
            "run.save_final_model": False,
            "logging.progress_bar": False,
            "logging.every_steps": 10**9,
            "logging.samples_every_steps": None,
        },
    )
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    stage = json.loads(next(Path(out_dir).glob("*/deepspeed.json")).read_text())[
        "zero_optimization"
    ]["stage"]
    Path(result).write_text(json.dumps({"history": history, "peak_mib": peak, "stage": stage}))


def main() -> None:
    from common import fmt, markdown_table, report

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny_cpu.json"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument("--child", nargs=2, metavar=("ZERO3", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="bench_one_rank_") as tmp:
            child(args.recipe, args.steps, args.child[0] == "1", tmp, args.child[1])
        return
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must be more than {WARMUP} (the first {WARMUP} are a warm-up)")

    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench_one_rank_") as tmp:
        for i in range(args.runs):
            for name, zero3 in VARIANTS.items():
                out = Path(tmp) / f"{i}_{int(zero3)}.json"
                print(f"  run {i + 1}/{args.runs}: {name} ...", file=sys.stderr, flush=True)
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--recipe",
                        args.recipe,
                        "--steps",
                        str(args.steps),
                        "--child",
                        str(int(zero3)),
                        str(out),
                    ],
                    check=True,
                    cwd=REPO,
                )
                results[name].append(json.loads(out.read_text()))

    rows = []
    for name, runs in results.items():
        steps = [m for r in runs for m in r["history"][WARMUP:]]
        rows.append(
            [
                name,
                str({r["stage"] for r in runs}.pop()),
                *[fmt(statistics.median(m[f"time_{p}_s"] for m in steps) * 1e3, 1) for p in PHASES],
                fmt(max(r["peak_mib"] for r in runs), 0),
            ]
        )
    headers = ["variant", "stage run", *[f"{p} ms" for p in PHASES], "peak RSS MiB"]
    body = markdown_table(headers, rows)

    one, three = (results[name][0]["history"][:WARMUP] for name in VARIANTS)
    diffs = {
        k: max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for a, b in zip(one, three, strict=True))
        for k in COMPARED
    }
    default, zero3 = (
        statistics.median(m["time_step_s"] for r in results[name] for m in r["history"][WARMUP:])
        for name in VARIANTS
    )
    notes = [
        f"{args.runs} runs per variant, alternating, each a fresh process (`grpo_ds.train.run`, "
        f"one rank); {args.steps} steps; medians over the steps after the first {WARMUP}",
        f"step time stage 1 / stage 3: {default / zero3:.2f}x",
        "largest relative difference over the first 5 steps (run 1 of each): "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
        "two or more ranks: ZeRO-3 runs as the file says (one_rank_stage applies to one rank "
        "only), so the default costs nothing there",
    ]
    recipe = Path(args.recipe).name
    report(
        "bench_one_rank_stage",
        f"{recipe}, ZeRO stage 1 vs 3 on one rank",
        "cpu",
        body,
        notes,
        args.record,
    )


if __name__ == "__main__":
    main()
