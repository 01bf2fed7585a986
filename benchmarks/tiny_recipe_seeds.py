"""The README's main job, seed by seed: does recipes/tiny_cpu.json keep learning, and how long does
it take?

    python benchmarks/tiny_recipe_seeds.py [--recipe recipes/tiny_cpu.json] [--seeds 0,1,2]
        [--record] [key=value ...]

Runs ``python -m grpo_ds.train RECIPE run.seed=S`` for each seed, one after the other, each in a
fresh process in a temporary output folder (extra key=value arguments are passed on as recipe
overrides), and reports per seed the mean reward of the last 10 steps (the target: >= 0.9), the
training time (the sum of the steps' time_step_s), the wall time of the whole command (start-up
included), and the last steps' entropy and no_signal_frac.
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


HEADERS = [
    "seed",
    "steps",
    "reward, last 10 steps",
    "training s",
    "wall s",
    "entropy (last step)",
    "no_signal_frac, last 10",
]


def run_seed(
    command: list[str],
    recipe: str,
    seed: int,
    out: str,
    overrides: list[str],
    env: dict[str, str] | None = None,
) -> tuple[list[dict], float]:
    """``command recipe run.seed=S ...`` in a fresh process (``command`` launches ``grpo_ds.train``:
    this Python or a deepspeed launcher), its run named seed<S> under ``out``; the run's metrics
    (one dict a step) and wall s."""
    began = time.monotonic()
    subprocess.run(
        [
            *command,
            recipe,
            f"run.seed={seed}",
            f"run.output_dir={out}",
            f"run.name=seed{seed}",
            "logging.progress_bar=false",
            *overrides,
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    wall = time.monotonic() - began
    return [json.loads(line) for line in (Path(out) / f"seed{seed}" / "metrics.jsonl").open()], wall


def seed_row(seed: int, metrics: list[dict], wall: float) -> tuple[list[str], float, float]:
    """A HEADERS row, the last-10 mean reward and the training s (the sum of the steps'
    time_step_s)."""
    from common import fmt

    final = statistics.fmean(m["reward_mean"] for m in metrics[-10:])
    train = sum(m["time_step_s"] for m in metrics)
    row = [
        str(seed),
        str(len(metrics)),
        fmt(final, 3),
        fmt(train, 1),
        fmt(wall, 1),
        fmt(metrics[-1]["entropy"], 3),
        fmt(statistics.fmean(m["no_signal_frac"] for m in metrics[-10:]), 2),
    ]
    return row, final, train


def main() -> None:
    from common import markdown_table, report, verdict

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/tiny_cpu.json")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides section.key=value, for every seed"
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    rows, finals, trains = [], [], []
    with tempfile.TemporaryDirectory(prefix="tiny_seeds_") as tmp:
        for seed in seeds:
            print(f"  seed {seed} ...", file=sys.stderr, flush=True)
            metrics, wall = run_seed(
                [sys.executable, "-m", "grpo_ds.train"], args.recipe, seed, tmp, args.overrides
            )
            row, final, train = seed_row(seed, metrics, wall)
            rows.append(row)
            finals.append(final)
            trains.append(train)

    body = markdown_table(HEADERS, rows)
    notes = [
        f"`python -m grpo_ds.train {args.recipe} run.seed=S` per seed, one after the other"
        + (f", overrides {' '.join(args.overrides)}" if args.overrides else ""),
        "training s: the sum of the steps' time_step_s; "
        "wall s: the whole command, start-up included",
        f"target (every seed's last-10 reward >= {TARGET}, in under 60 s of training): "
        f"{verdict(min(finals) >= TARGET and max(trains) < 60)}",
    ]
    # a question of its own on the docs' page
    changed = f" with {' '.join(args.overrides)}" if args.overrides else ""
    report(
        "tiny_recipe_seeds",
        f"{Path(args.recipe).name}{changed}, seeds {args.seeds}",
        "cpu",
        body,
        notes,
        args.record,
    )


if __name__ == "__main__":
    main()
