"""Colocated vs split placement on this CPU with real vLLM (issue 35): step time, samples/s, each
side's idle share.

    python benchmarks/bench_placement.py [--steps 14] [--skip 4] [--record] [key=value ...]
    python benchmarks/bench_placement.py --learns [--seeds 0,1,2] [--record] [key=value ...]
    python benchmarks/bench_placement.py --long-tail --steps 100 --skip 10 [--record]

The first form launches recipes/tiny_vllm_cpu.json three times, one after the other, through the
vLLM environment's deepspeed launcher (``.venv-vllm/bin/deepspeed``, the CPU build of vLLM; a
symlink to the main checkout's) with 2 ranks pinned one core each (``--bind_cores_to_rank``, which
needs numactl):
    colocated            both ranks generate their half, then both train their half, in turn
    split K=1 S=0        rank 1 generates every sample, rank 0 trains; the sides take turns
    split K=1 S=1        the same, the rollout rank one step ahead: generation overlaps training
at the shape in SHAPE (overridable by key=value arguments), chosen so that one core generating a
step's samples takes about as long as one core training on them. The first ``--skip`` steps of each
run are dropped (start-up, the pipeline's fill); the table shows the rest: the median step (the
trainer's wall step, its wait included), samples/s (samples per step / median step), and each side's
idle fraction (idle s / step s, summed over the steady steps):
    split      trainer placement/trainer_idle_s, rollout placement/rollout_idle_s (the rank logs'
               spans)
    colocated  the ranks are the trainer while they train and the rollout engine while they
               generate: the trainer idles through rollout + reward, the engine through logprob +
               update + sync
Both sides' busy seconds per step are printed so the balance shows. Targets: split S=1's step <=
0.65 x split S=0's, and the trainer idle <= 15% at S=1.

It then writes the placement model's --measured file (benchmarks/simulate_placement.py: one run a
row, each with its phases) with inputs derived from the colocated and S=0 runs' per-phase medians,
and runs the model against it, printing its error per row (target: within +-15%).

``--long-tail`` compares split S=1 batch by batch with split S=1 continuous generation
(rollout.continuous) on a long tail of completion lengths, with the hf engine and with vLLM, and
checks the placement model's continuous rows against them: benchmarks/long_tail.py.

``--learns`` runs recipes/tiny_vllm_cpu.json split with S=1 (1 trainer + 1 rollout rank, pinned one
core each: the machine has 2 cores) for its full 260 steps per seed, through tiny_recipe_seeds'
runner, and reports per seed the last-10 mean reward (target >= 0.9) and the largest staleness seen
(target <= 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

RECIPE = "recipes/tiny_vllm_cpu.json"
LAUNCHER = REPO / ".venv-vllm" / "bin" / "deepspeed"
# 25 prompts x 64 = 1,600 samples a step. At the recipe's 2 new tokens one core generated a step in
# about half the time another trained on it (a trial split S=1 run); 4 new tokens double the decode
# steps to bring the sides level.
SHAPE = ["rollout.max_new_tokens=4"]
SPLIT = ['rollout.placement="split"', "rollout.ranks=1"]
LAYOUTS = (
    ("colocated", 0, 0, []),
    ("split", 1, 0, [*SPLIT, "rollout.max_staleness=0"]),
    ("split", 1, 1, [*SPLIT, "rollout.max_staleness=1"]),
)
STEP_RATIO_TARGET = 0.65  # split S=1 step / split S=0 step
TRAINER_IDLE_TARGET = 0.15  # at S=1
MODEL_TOLERANCE = 0.15


# --------------------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class RunSummary:
    """The steady steps of one launch."""

    placement: str
    rollout_ranks: int  # K; 0 colocated
    staleness: int
    steps: int  # steady steps kept
    step_s: float  # median time_step_s
    mean_step_s: float
    samples_per_step: int
    trainer_busy_s: float  # per step, mean over the steady steps
    rollout_busy_s: float
    trainer_idle: float  # fraction of the steady steps' wall time
    rollout_idle: float
    # median seconds per phase: rollout, reward, logprob, update, sync (what the run records)
    phases: dict
    staleness_max: int
    wall_step_s: float | None = None  # rank 0's step end to step end (wall_per_step)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def steady(metrics: list[dict], skip: int) -> list[dict]:
    """The steps after the first ``skip`` (start-up and the pipeline's fill); ValueError when none
    is left."""
    kept = [m for m in metrics if m["step"] > skip]
    if not kept:
        raise ValueError(
            f"no steady step: the run has {len(metrics)} steps and the first {skip} are dropped"
        )
    return kept


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(m.get(key, 0.0) for m in steps)


def summarize(
    metrics: list[dict],
    placement: str,
    rollout_ranks: int,
    staleness: int,
    samples_per_step: int,
    skip: int,
) -> RunSummary:
    """A run's steady steps as a table row: the median step, idle fractions over the summed wall
    time, and the per-phase medians (split runs: the rollout side's phases as the rollout rank
    reports them)."""
    steps = steady(metrics, skip)
    wall = sum(m["time_step_s"] for m in steps)
    mean = lambda key: sum(m.get(key, 0.0) for m in steps) / len(steps)  # noqa: E731
    if placement == "colocated":
        gen = [m["time_rollout_s"] + m.get("time_reward_s", 0.0) for m in steps]
        train = [
            m.get("time_logprob_s", 0.0) + m["time_update_s"] + m.get("time_sync_s", 0.0)
            for m in steps
        ]
        trainer_busy, rollout_busy = sum(train) / len(steps), sum(gen) / len(steps)
        trainer_idle, rollout_idle = sum(gen) / wall, sum(train) / wall
        phases = {
            "rollout": _median(steps, "time_rollout_s"),
            "reward": _median(steps, "time_reward_s"),
        }
    else:
        trainer_busy, rollout_busy = (
            mean("placement/trainer_busy_s"),
            mean("placement/rollout_busy_s"),
        )
        trainer_idle = sum(m["placement/trainer_idle_s"] for m in steps) / wall
        # the rollout rank's own time (its steps are its generate calls, not aligned with the
        # trainer's steps)
        rollout_idle = sum(m["placement/rollout_idle_s"] for m in steps) / sum(
            m["placement/rollout_busy_s"] + m["placement/rollout_idle_s"] for m in steps
        )
        phases = {
            "rollout": _median(steps, "rollout_side/time_rollout_s"),
            "reward": _median(steps, "rollout_side/time_reward_s"),
        }
    phases.update(
        logprob=_median(steps, "time_logprob_s"),
        update=_median(steps, "time_update_s"),
        sync=_median(steps, "time_sync_s"),
    )
    return RunSummary(
        placement,
        rollout_ranks,
        staleness,
        len(steps),
        statistics.median(m["time_step_s"] for m in steps),
        wall / len(steps),
        samples_per_step,
        trainer_busy,
        rollout_busy,
        trainer_idle,
        rollout_idle,
        phases,
        max(int(m.get("placement/staleness_max", 0)) for m in steps),
    )


def wall_per_step(rank_log: list[dict], skip: int) -> float | None:
    """Wall seconds a steady step on a rank's log (ranks/rank<r>.jsonl), step end to step end:
    time_step_s leaves out what a rank does between steps (metrics, logging); None when the log has
    too few steps with spans."""
    ends = {
        r["step"]: max(p[2] for p in r["phases"])
        for r in rank_log
        if r.get("step") and r.get("phases")
    }
    kept = sorted(k for k in ends if k >= skip)
    if len(kept) < 2:
        return None
    return (ends[kept[-1]] - ends[kept[0]]) / (kept[-1] - kept[0])


def find(runs: list[RunSummary], placement: str, staleness: int) -> RunSummary:
    return next(r for r in runs if r.placement == placement and r.staleness == staleness)


def targets(runs: list[RunSummary]) -> tuple[float, float, bool, bool]:
    """split S=1 step / split S=0 step, S=1's trainer idle fraction, and whether each meets its
    target."""
    s0, s1 = find(runs, "split", 0), find(runs, "split", 1)
    ratio = s1.step_s / s0.step_s
    return (
        ratio,
        s1.trainer_idle,
        ratio <= STEP_RATIO_TARGET,
        s1.trainer_idle <= TRAINER_IDLE_TARGET,
    )


def table(runs: list[RunSummary]) -> str:
    from common import fmt, markdown_table

    headers = [
        "placement",
        "K",
        "S",
        "step s (median)",
        "samples/s",
        "trainer idle",
        "rollout idle",
        "trainer busy s",
        "rollout busy s",
        "wall s a step (rank 0)",
        "steady steps",
    ]
    rows = [
        [
            r.placement,
            str(r.rollout_ranks),
            str(r.staleness),
            fmt(r.step_s, 3),
            fmt(r.samples_per_s, 0),
            f"{r.trainer_idle:.1%}",
            f"{r.rollout_idle:.1%}",
            fmt(r.trainer_busy_s, 3),
            fmt(r.rollout_busy_s, 3),
            fmt(r.wall_step_s, 3),
            str(r.steps),
        ]
        for r in runs
    ]
    return markdown_table(headers, rows)


def target_notes(runs: list[RunSummary]) -> list[str]:
    from common import fmt, verdict

    ratio, idle, ratio_ok, idle_ok = targets(runs)
    colocated, s0, s1 = find(runs, "colocated", 0), find(runs, "split", 0), find(runs, "split", 1)
    notes = [
        f"split S=1 / split S=0 step: {fmt(ratio, 3)}; target (split S=1 step <= "
        f"{STEP_RATIO_TARGET} x split S=0's): {verdict(ratio_ok)}",
        f"trainer idle at S=1: {idle:.1%}; target (trainer idle at S=1 <= "
        f"{TRAINER_IDLE_TARGET:.0%}): {verdict(idle_ok)}",
        f"colocated beside them: step {fmt(colocated.step_s, 3)} s; split S=0 / colocated step "
        f"{fmt(s0.step_s / colocated.step_s, 3)}, split S=1 / colocated step "
        f"{fmt(s1.step_s / colocated.step_s, 3)}",
    ]
    if s0.wall_step_s and s1.wall_step_s:
        between = ", ".join(
            f"{name} {fmt(r.wall_step_s - r.mean_step_s, 3)} s"
            for name, r in (("colocated", colocated), ("S=0", s0), ("S=1", s1))
            if r.wall_step_s
        )
        notes.append(
            f"by rank 0's wall s a step instead of time_step_s: split S=1 / split S=0 "
            f"{fmt(s1.wall_step_s / s0.wall_step_s, 3)}; wall s a step minus the mean time_step_s "
            f"(what rank 0 does between steps): {between}"
        )
    return notes


def model_inputs(runs: list[RunSummary], token_steps: int, mean_new_tokens: float) -> dict:
    """simulate_placement's inputs from the measured phases: the decode cost per token step from the
    rollout phase at two batch sizes (colocated: N/2 samples a rank, split: N on the rollout rank;
    each placed at the batch a decode step sees on average, x mean_new_tokens / token_steps, where
    the model reads it), the per-sample training costs from the split S=0 trainer (one rank trains
    all N), the reward and the syncs as measured."""
    colocated, s0 = find(runs, "colocated", 0), find(runs, "split", 0)
    n = s0.samples_per_step
    per_step = lambda r: r.phases["rollout"] / token_steps  # noqa: E731
    # the model reads t_token at the batch a decode step sees on average
    active = mean_new_tokens / token_steps
    return {
        "samples_per_step": n,
        "token_steps": token_steps,
        "mean_new_tokens": mean_new_tokens,
        "t_token": [[math.ceil(n / 2) * active, per_step(colocated)], [n * active, per_step(s0)]],
        "train_s_per_sample": s0.phases["update"] / n,
        "logprob_s_per_sample": s0.phases["logprob"] / n,
        "train_efficiency": (s0.phases["update"] + s0.phases["logprob"])
        / (2 * (colocated.phases["update"] + colocated.phases["logprob"])),
        "reward_s": s0.phases["reward"],
        "reward_side": "rollout",
        "sync_s": colocated.phases["sync"],
        "split_sync_s": s0.phases["sync"],
        "world": 2,
        "rollout_ranks": 1,
        "staleness": 1,
    }


def measured_file(runs: list[RunSummary], inputs: dict, machine: str, commit: str) -> dict:
    """simulate_placement's --measured format (its docstring); step_s is the mean of the steady
    steps."""
    return {
        "machine": machine,
        "commit": commit,
        "inputs": inputs,
        "runs": [
            {
                "placement": r.placement,
                "world": 2,
                "rollout_ranks": r.rollout_ranks,
                "staleness": r.staleness,
                "step_s": r.mean_step_s,
                "samples_per_step": r.samples_per_step,
                "phases": r.phases,
            }
            for r in runs
        ],
    }


# ---------------------------------------------------------------------------------------- launching


def launcher_command(port: int) -> list[str]:
    if not LAUNCHER.exists():
        raise SystemExit(
            f"{LAUNCHER.relative_to(REPO)} is missing: ln -s /work/main/.venv-vllm .venv-vllm "
            "(the vLLM CPU build's environment)"
        )
    if shutil.which("numactl") is None:
        raise SystemExit(
            "numactl is missing: deepspeed's --bind_cores_to_rank pins each rank with it "
            "(apt-get install numactl)"
        )
    return [
        str(LAUNCHER),
        "--num_gpus",
        "2",
        "--bind_cores_to_rank",
        "--master_port",
        str(port),
        "--module",
        "grpo_ds.train",
    ]


def launch_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DS_ACCELERATOR": "cpu",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def launch(
    out: Path, name: str, overrides: list[str], port: int, import_path: str | None = None
) -> list[dict]:
    """One run through the launcher; its metrics. The log goes to out/name.log, its tail printed on
    failure. ``import_path``: a folder the ranks import from besides the checkout (reward
    modules)."""
    log = out / f"{name}.log"
    command = [
        *launcher_command(port),
        RECIPE,
        f"run.output_dir={out}",
        f"run.name={name}",
        "logging.progress_bar=false",
        "checkpoint.every_steps=null",
        *overrides,
    ]
    env = launch_env()
    if import_path:
        env["PYTHONPATH"] = f"{import_path}:{env['PYTHONPATH']}"
    with log.open("w") as f:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"{name}: the launch failed (exit {done.returncode}); log {log}")
    return read_metrics(out / name / "metrics.jsonl")


def recipe_value(section: str, key: str, overrides: list[str]) -> object:
    for item in reversed(overrides):
        k, _, v = item.partition("=")
        if k == f"{section}.{key}":
            return json.loads(v)
    return json.loads((REPO / RECIPE).read_text())[section][key]


def bench(args: argparse.Namespace) -> None:
    from common import commit, machine, report, verdict

    overrides = [*SHAPE, f"train.steps={args.steps}", *args.overrides]
    n = recipe_value("rollout", "prompts_per_step", overrides) * recipe_value(
        "rollout", "group_size", overrides
    )
    token_steps = recipe_value("rollout", "max_new_tokens", overrides)
    runs, new_tokens = [], []
    with tempfile.TemporaryDirectory(prefix="bench_placement_") as tmp:
        for i, (placement, k, s, extra) in enumerate(LAYOUTS):
            name = placement if placement == "colocated" else f"split_k{k}_s{s}"
            print(f"  {name} ({args.steps} steps) ...", file=sys.stderr, flush=True)
            metrics = launch(Path(tmp), name, [*overrides, *extra], args.port + i)
            summary = summarize(metrics, placement, k, s, n, args.skip)
            rank0 = read_metrics(Path(tmp) / name / "ranks" / "rank0.jsonl")
            runs.append(dataclasses.replace(summary, wall_step_s=wall_per_step(rank0, args.skip)))
            new_tokens += [
                m.get("response_len_mean", token_steps) for m in steady(metrics, args.skip)
            ]
        inputs = model_inputs(runs, token_steps, min(statistics.fmean(new_tokens), token_steps))
        measured = measured_file(runs, inputs, machine("cpu"), commit())
        path = Path(args.measured_out or Path(tmp) / "measured.json")
        path.write_text(json.dumps(measured, indent=1) + "\n")
        model_text, model_ok = simulate(path)
    body = (
        table(runs)
        + "\n\nThe placement model (`benchmarks/simulate_placement.py --measured`) against these "
        "runs:\n\n" + "\n".join("    " + line for line in model_text.splitlines())
    )
    shape = ", ".join(overrides[: -len(args.overrides)] if args.overrides else overrides)
    notes = [
        f"{RECIPE} with {', '.join([*SHAPE, *args.overrides])}: {n} samples a step; 2 ranks pinned "
        "one core each (deepspeed --bind_cores_to_rank), vLLM's CPU "
        "build; each layout a fresh launch, one after the other",
        "the shape, how chosen: a trial split S=1 run at the recipe's 2 new tokens left the "
        "rollout rank idle about half of each step (generation about half the training's time on "
        f"one core each); {token_steps} new tokens double the decode steps to bring the sides "
        "level; the busy s columns show the balance reached (trainer: logprob + update + sync and "
        "its waits excluded; rollout: generate + reward + sends)",
        f"steady state: the first {args.skip} of {args.steps} steps dropped (start-up, the "
        "pipeline's fill); step s: median time_step_s (the trainer's wall step, its wait "
        "included); idle: idle s / wall s summed over the steady steps (split rollout: over the "
        "rollout rank's own busy + idle s, its steps being its generate calls); colocated: the "
        "ranks idle as trainer while they generate and score, as engine while they train and sync; "
        "wall s a step: rank 0's step end to step end, what "
        "it does between steps (metrics, logging) included",
        *target_notes(runs),
        "placement model: inputs derived from the colocated and split S=0 runs' median phases "
        f"(t_token at {math.ceil(n / 2)} and {n} samples a rank from their rollout phase / "
        f"{token_steps} token steps; per-sample train and log-prob costs from the S=0 trainer, "
        "reward and syncs as measured), step s compared: the mean of the steady steps",
        f"target (placement model: every row within +-{MODEL_TOLERANCE:.0%} of the measured step): "
        f"{verdict(model_ok)}",
        f"model inputs: `{json.dumps(inputs)}`",
        f"largest staleness seen at S=1: {find(runs, 'split', 1).staleness_max}",
    ]
    report(
        "bench_placement",
        f"colocated vs split S=0 vs S=1, {shape}, cpu",
        "cpu",
        body,
        notes,
        args.record,
    )


def simulate(path: Path) -> tuple[str, bool]:
    """benchmarks/simulate_placement.py --measured ``path``: its table (without its machine line)
    and whether every row is within its tolerance."""
    model = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "simulate_placement.py"),
            "--measured",
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    if model.returncode not in (0, 1):
        raise SystemExit(f"simulate_placement failed: {model.stderr}")
    return model.stdout.split("\n", 1)[1].rstrip(), model.returncode == 0


def learns(args: argparse.Namespace) -> None:
    from common import fmt, markdown_table, report, verdict
    from tiny_recipe_seeds import HEADERS, TARGET, run_seed, seed_row

    overrides = [*SPLIT, "rollout.max_staleness=1", *args.overrides]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows, finals, stale = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_placement_learns_") as tmp:
        for seed in seeds:
            print(f"  seed {seed} ...", file=sys.stderr, flush=True)
            metrics, wall = run_seed(
                launcher_command(args.port), RECIPE, seed, tmp, overrides, env=launch_env()
            )
            row, final, _ = seed_row(seed, metrics, wall)
            most = max(int(m["placement/staleness_max"]) for m in metrics)
            rows.append([*row, str(most)])
            finals.append(final)
            stale.append(most)
    body = markdown_table([*HEADERS, "staleness max"], rows)
    notes = [
        f"`deepspeed --num_gpus 2 --bind_cores_to_rank --module grpo_ds.train {RECIPE} run.seed=S "
        f"{' '.join(overrides)}` per seed (the vLLM environment's launcher), one after the other: "
        "1 trainer rank + 1 rollout rank, one core each (the machine has 2 cores, so not 2 + 1)",
        "training s: the sum of the steps' time_step_s; wall s: the whole command, start-up "
        "included; staleness max: the largest placement/staleness_max of the run",
        f"target (every seed's last-10 reward >= {TARGET}): {verdict(min(finals) >= TARGET)}",
        f"target (every sample's staleness <= 1): {verdict(max(stale) <= 1)}",
        f"lowest last-10 reward: {fmt(min(finals), 3)}",
    ]
    # a question of its own on the docs' page
    changed = f" with {' '.join(args.overrides)}" if args.overrides else ""
    report(
        "bench_placement",
        f"learns, {Path(RECIPE).name} split K=1 S=1{changed}, seeds {args.seeds}",
        "cpu",
        body,
        notes,
        args.record,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=14, help="steps a launch")
    parser.add_argument("--skip", type=int, default=4, help="first steps dropped from each run")
    parser.add_argument("--learns", action="store_true", help="split S=1 seeds, the full recipe")
    parser.add_argument(
        "--long-tail",
        action="store_true",
        help="split S=1 batch by batch vs continuous on a long tail of lengths (benchmarks/"
        "long_tail.py; use --steps 100 --skip 10)",
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--port", type=int, default=29930, help="the launcher's master port (one more per launch)"
    )
    parser.add_argument("--measured-out", help="also keep the --measured JSON here")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides section.key=value, for every launch"
    )
    args = parser.parse_args()
    if args.learns:
        learns(args)
    elif args.long_tail:
        import long_tail

        long_tail.run(args, launch, simulate)
    else:
        if args.skip >= args.steps:
            parser.error("--skip must be less than --steps")
        bench(args)


if __name__ == "__main__":
    main()
