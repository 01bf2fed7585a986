"""The README's main job, seed by seed: does recipes/tiny_cpu.json keep learning, and how long does
it take? And with --all, every tiny recipe the repository ships.

    python benchmarks/tiny_recipe_seeds.py [--recipe recipes/tiny_cpu.json] [--seeds 0,1,2]
        [--record] [key=value ...]
    python benchmarks/tiny_recipe_seeds.py --all [--seeds 0,1,2] [--record]

Runs ``python -m grpo_ds.train RECIPE run.seed=S`` for each seed, one after the other, each in a
fresh process in a temporary output folder (extra key=value arguments are passed on as recipe
overrides), and reports per seed the mean reward of the last 10 steps (the target: >= 0.9), the
training time (the sum of the steps' time_step_s), the wall time of the whole command (start-up
included), and the last steps' entropy and no_signal_frac.

--all runs each tiny recipe (TINY: tiny, DAPO, LoRA, multi-turn, reward model, vLLM, split) as its
page says to, seed by seed, and writes one row a recipe: the worst and mean last-10 reward over the
seeds, the longest training, and the verdict against the same target. The vLLM recipe runs in the
vLLM CPU build's environment (.venv-vllm, as bash .ci/vllm-venv makes it); the split one through
python -m grpo_ds.launch on 2 CPU ranks (1 trainer + 1 rollout rank, rollout.max_staleness 1,
lr 7e-4 for 300 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

TARGET = 0.9
TRAINING_S = 60  # the target's training time, the sum of the steps' time_step_s


class Tiny(NamedTuple):
    """A tiny recipe as --all runs it: its name, file, launch ("python", "vllm": the vLLM
    environment's Python, "split": 2 CPU ranks through grpo_ds.launch) and overrides."""

    name: str
    recipe: str
    launch: str = "python"
    overrides: tuple[str, ...] = ()


TINY = [
    Tiny("tiny", "recipes/tiny_cpu.json"),
    Tiny("DAPO", "recipes/dapo_tiny_cpu.json"),
    Tiny("LoRA", "recipes/lora_tiny_cpu.json"),
    Tiny("multi-turn", "recipes/multiturn_tiny_cpu.json"),
    Tiny("reward model", "recipes/rm_tiny_cpu.json"),
    Tiny("vLLM", "recipes/tiny_vllm_cpu.json", "vllm"),
    Tiny(
        "split",
        "recipes/tiny_cpu.json",
        "split",
        (
            'rollout.placement="split"',
            "rollout.ranks=1",
            "rollout.max_staleness=1",
            "algorithm.rollout_is_cap=2",
            # staleness 1 at the recipe's lr 1e-3 collapses after ~250 steps (docs/guides/
            # placement.md, "Staleness and the learning rate")
            "train.lr=0.0007",
            "train.steps=300",
        ),
    ),
]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


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


def launch_command(launch: str) -> tuple[list[str], dict[str, str] | None]:
    """The command that starts grpo_ds.train for ``launch``, and its environment."""
    if launch == "python":
        return [sys.executable, "-m", "grpo_ds.train"], None
    if launch == "vllm":
        if not VLLM_PYTHON.exists():
            raise SystemExit(
                f"{VLLM_PYTHON.relative_to(REPO)} is missing: bash .ci/vllm-venv makes the vLLM "
                "CPU build's environment"
            )
        return [str(VLLM_PYTHON), "-m", "grpo_ds.train"], None
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    return [
        sys.executable,
        "-m",
        "grpo_ds.launch",
        "--num_gpus",
        "2",
        "--module",
        "grpo_ds.train",
    ], env


def run_all(seeds: list[int], record: bool) -> None:
    """--all: every tiny recipe, seed by seed; one row a recipe."""
    from common import fmt, markdown_table, report, verdict

    rows, verdicts = [], []
    with tempfile.TemporaryDirectory(prefix="tiny_all_") as tmp:
        for tiny in TINY:
            command, env = launch_command(tiny.launch)
            finals, trains = [], []
            try:
                for seed in seeds:
                    print(f"  {tiny.name}, seed {seed} ...", file=sys.stderr, flush=True)
                    out = Path(tmp) / tiny.name.replace(" ", "_")
                    metrics, wall = run_seed(
                        command, tiny.recipe, seed, str(out), list(tiny.overrides), env
                    )
                    _, final, train = seed_row(seed, metrics, wall)
                    finals.append(final)
                    trains.append(train)
            except subprocess.CalledProcessError as err:  # a row that says so; the others run
                verdicts.append(False)
                rows.append(
                    [
                        tiny.name,
                        " ".join([tiny.recipe, *tiny.overrides]),
                        "-",
                        "-",
                        "-",
                        f"failed (exit {err.returncode}, seed {seed})",
                    ]
                )
                continue
            met = min(finals) >= TARGET and max(trains) < TRAINING_S
            verdicts.append(met)
            rows.append(
                [
                    tiny.name,
                    " ".join([tiny.recipe, *tiny.overrides]),
                    fmt(min(finals), 3),
                    fmt(statistics.fmean(finals), 3),
                    fmt(max(trains), 1),
                    verdict(met),
                ]
            )
    headers = [
        "recipe",
        "file",
        "reward, last 10 (worst seed)",
        "(mean)",
        "training s (longest seed)",
        "target",
    ]
    notes = [
        f"seeds {','.join(map(str, seeds))}, each a fresh process, one after the other; vLLM in "
        ".venv-vllm; split through `python -m grpo_ds.launch --num_gpus 2` (1 trainer + 1 rollout "
        "rank)",
        "training s: the sum of the steps' time_step_s",
        f"target (every seed's last-10 reward >= {TARGET}, in under {TRAINING_S} s of training): "
        f"{verdict(all(verdicts))}",
    ]
    report(
        "tiny_recipe_seeds",
        f"every tiny recipe, seeds {','.join(map(str, seeds))}",
        "cpu",
        markdown_table(headers, rows),
        notes,
        record,
    )


def main() -> None:
    from common import markdown_table, report, verdict

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/tiny_cpu.json")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--all", action="store_true", help="every tiny recipe (TINY), a row each")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides section.key=value, for every seed"
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.all:
        run_all(seeds, args.record)
        return

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
        f"target (every seed's last-10 reward >= {TARGET}, in under {TRAINING_S} s of training): "
        f"{verdict(min(finals) >= TARGET and max(trains) < TRAINING_S)}",
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
