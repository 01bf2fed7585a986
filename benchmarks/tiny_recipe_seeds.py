"""The README's main job, seed by seed: does recipes/tiny_cpu.json keep learning, and how long does it take?

    python benchmarks/tiny_recipe_seeds.py [--recipe recipes/tiny_cpu.json] [--seeds 0,1,2] [--record] [key=value ...]

Runs ``python -m grpo_ds.train RECIPE run.seed=S`` for each seed, one after the other, each in a fresh process in a
temporary output folder (extra key=value arguments are passed on as recipe overrides), and reports per seed the
mean reward of the last 10 steps (the target: >= 0.9), the training time (the sum of the steps' time_step_s), the
wall time of the whole command (start-up included), and the last steps' entropy and no_signal_frac.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

TARGET = 0.9


def main() -> None:
    from common import fmt, markdown_table, report, verdict

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny_cpu.json")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("overrides", nargs="*", help="recipe overrides section.key=value, for every seed")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    rows, finals, trains = [], [], []
    with tempfile.TemporaryDirectory(prefix="tiny_seeds_") as tmp:
        for seed in seeds:
            print(f"  seed {seed} ...", file=sys.stderr, flush=True)
            began = time.monotonic()
            subprocess.run([sys.executable, "-m", "grpo_ds.train", args.recipe, f"run.seed={seed}",
                            f"run.output_dir={tmp}", f"run.name=seed{seed}", "logging.progress_bar=false",
                            *args.overrides], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            wall = time.monotonic() - began
            metrics = [json.loads(line) for line in (Path(tmp) / f"seed{seed}" / "metrics.jsonl").open()]
            final = statistics.fmean(m["reward_mean"] for m in metrics[-10:])
            train = sum(m["time_step_s"] for m in metrics)
            finals.append(final)
            trains.append(train)
            rows.append([str(seed), str(len(metrics)), fmt(final, 3), fmt(train, 1), fmt(wall, 1),
                         fmt(metrics[-1]["entropy"], 3),
                         fmt(statistics.fmean(m["no_signal_frac"] for m in metrics[-10:]), 2)])

    headers = ["seed", "steps", "reward, last 10 steps", "training s", "wall s", "entropy (last step)",
               "no_signal_frac, last 10"]
    body = markdown_table(headers, rows)
    notes = [f"`python -m grpo_ds.train {args.recipe} run.seed=S` per seed, one after the other"
             + (f", overrides {' '.join(args.overrides)}" if args.overrides else ""),
             "training s: the sum of the steps' time_step_s; wall s: the whole command, start-up included",
             f"target (every seed's last-10 reward >= {TARGET}, in under 60 s of training): "
             f"{verdict(min(finals) >= TARGET and max(trains) < 60)}"]
    report("tiny_recipe_seeds", f"{Path(args.recipe).name}, seeds {args.seeds}", "cpu", body, notes, args.record)


if __name__ == "__main__":
    main()
