"""Reward worker processes: seconds per step for a CPU-bound verifier, and what the pool costs the
tiny recipe.

    python benchmarks/bench_reward_pool.py [--samples 1024] [--work-ms 20] [--repeats 3] [--record]
    python benchmarks/bench_reward_pool.py --tiny-before REV [--pairs 3] [--record]

The first form scores ``--samples`` completions (groups of 8) with a verifier that spends
``--work-ms`` of CPU time per sample (a busy loop on the process's CPU clock: no sleep), through
``grpo_ds.rewards.score_functions`` exactly as a step does: in the trainer's process
(``reward.processes=0``), with 1 worker, and with one worker per core. It also times a function that
does nothing, to measure what one chunk's round trip to a worker costs, and from that estimates the
time on a 32-core node.

The second form runs the tiny recipe (``python -m grpo_ds.train recipes/tiny_cpu.json``) alternately
from a checkout of REV (a git worktree, made and removed here) and from this one, ``--pairs`` times
each, and compares the training time (the sum of the steps' time_step_s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
GROUP = 8


def verify(*, completions, work_ms, **kwargs):
    """~work_ms of CPU per sample; scores whether the completion's length is even."""
    scores = []
    for text in completions:
        end, h = time.process_time() + work_ms[0] / 1000, 0
        while time.process_time() < end:
            h = (h * 31 + len(text)) % 1_000_003
        scores.append(float(len(text) % 2 == 0))
    return scores


def noop(*, completions, **kwargs):
    return [0.0] * len(completions)


def _score_seconds(
    name: str, processes: int, chunk_samples: int, n: int, work_ms: float, repeats: int
) -> tuple[float, list[float]]:
    from grpo_ds.config.reward_specs import RewardFunctionSpec
    from grpo_ds.rewards import load_reward_functions, score_functions
    from grpo_ds.rewards.pool import RewardPool

    spec = [RewardFunctionSpec(f"bench_reward_pool:{name}", 1.0)]
    pool = RewardPool(spec, processes) if processes else None
    batch = dict(
        prompts=[f"p{i // GROUP}" for i in range(n)],
        completions=[f"answer {i}" for i in range(n)],
        completion_ids=[[i] for i in range(n)],
        columns={"work_ms": [work_ms] * n},
        on_error="fail",
        timeout_s=600,
        chunk_samples=chunk_samples,
        group_size=GROUP,
        pool=pool,
    )
    functions = load_reward_functions(spec)
    try:
        first_group = {
            **batch,
            "completions": batch["completions"][:GROUP],
            "prompts": batch["prompts"][:GROUP],
            "completion_ids": batch["completion_ids"][:GROUP],
            "columns": {"work_ms": [work_ms] * GROUP},
        }
        score_functions(functions, **first_group)  # the workers are up
        times, totals = [], None
        for _ in range(repeats):
            began = time.perf_counter()
            totals = score_functions(functions, **batch).total
            times.append(time.perf_counter() - began)
    finally:
        if pool is not None:
            pool.close()
    return statistics.median(times), totals


def verifier_table(args: argparse.Namespace) -> tuple[str, list[str]]:
    from common import fmt, markdown_table

    cores = len(os.sched_getaffinity(0))
    n, chunk = args.samples, args.chunk_samples
    chunks = math.ceil(n / chunk)
    rows, reference, scores = [], None, set()
    for processes in (0, 1, cores):
        seconds, totals = _score_seconds("verify", processes, chunk, n, args.work_ms, args.repeats)
        scores.add(tuple(totals))
        reference = reference or seconds
        where = (
            "the trainer's process (reward.processes=0)"
            if not processes
            else f"{processes} worker{'s' if processes > 1 else ''}"
            + (" (all cores)" if processes == cores else "")
        )
        rows.append([where, fmt(seconds, 2), fmt(reference / seconds, 2)])
    assert len(scores) == 1, "the scores differ between the pool sizes"
    noop_s, _ = _score_seconds("noop", 1, chunk, n, 0.0, args.repeats)
    per_chunk_ms = noop_s / chunks * 1000
    work_s = n * args.work_ms / 1000
    estimates = []
    for chunk_size in (chunk, 32):
        count = math.ceil(n / chunk_size)
        node = math.ceil(count / 32) * (chunk_size * args.work_ms / 1000 + per_chunk_ms / 1000)
        estimates.append(
            f"on a 32-core node with reward.processes=32 and chunk_samples={chunk_size} "
            f"({count} chunks): about {fmt(node, 2)} s, {fmt(work_s / node, 1)}x the serial "
            f"{fmt(work_s, 1)} s (ceil(chunks / 32) x (chunk work + {fmt(per_chunk_ms, 2)} ms))"
        )
    body = markdown_table(["where the verifier runs", "reward s per step", "speed-up"], rows)
    notes = [
        f"{n} completions in groups of {GROUP}, reward.chunk_samples={chunk} ({chunks} chunks); "
        f"the verifier spends {args.work_ms:g} ms of CPU per "
        f"sample (busy loop, no sleep); median of {args.repeats}",
        f"machine: {cores} cores; the scores are identical in every row (checked)",
        "one chunk's round trip to a worker (a function "
        f"that does nothing): {fmt(per_chunk_ms, 2)} ms",
        *estimates,
    ]
    return body, notes


def _training_seconds(cwd: Path, out: str) -> float:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_ds.train",
            "recipes/tiny_cpu.json",
            f"run.output_dir={out}",
            "run.overwrite=true",
            "logging.progress_bar=false",
        ],
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = [json.loads(line) for line in (Path(out) / "tiny_cpu" / "metrics.jsonl").open()]
    return sum(m["time_step_s"] for m in metrics)


def tiny_table(args: argparse.Namespace) -> tuple[str, list[str]]:
    from common import fmt, markdown_table, verdict

    before, after = [], []
    with tempfile.TemporaryDirectory(prefix="reward_pool_") as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), args.tiny_before],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        try:
            for pair in range(args.pairs):
                print(f"  pair {pair + 1} of {args.pairs} ...", file=sys.stderr, flush=True)
                before.append(_training_seconds(tree, f"{tmp}/a"))
                after.append(_training_seconds(REPO, f"{tmp}/b"))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False
            )
    ratio = statistics.median(after) / statistics.median(before)
    rows = [
        [
            f"before ({args.tiny_before})",
            " ".join(fmt(t, 1) for t in before),
            fmt(statistics.median(before), 2),
        ],
        [
            "after (this commit, reward worker pool)",
            " ".join(fmt(t, 1) for t in after),
            fmt(statistics.median(after), 2),
        ],
    ]
    body = markdown_table(["code", "training s per run", "median"], rows)
    notes = [
        "`python -m grpo_ds.train recipes/tiny_cpu.json` (260 steps), runs alternating before, "
        "after; training s is the sum of the steps' time_step_s",
        f"after / before: {fmt(ratio, 3)}; target (not "
        f"worse by more than 3%): {verdict(ratio <= 1.03)}",
    ]
    return body, notes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--work-ms", type=float, default=20.0)
    parser.add_argument("--chunk-samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tiny-before", metavar="REV", help="compare the tiny recipe's training time with REV's"
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    from common import report

    if args.tiny_before:
        body, notes = tiny_table(args)
        report(
            "bench_reward_pool",
            "the tiny recipe, before and after",
            "cpu",
            body,
            notes,
            args.record,
        )
    else:
        body, notes = verifier_table(args)
        report(
            "bench_reward_pool",
            f"{args.samples} completions x {args.work_ms:g} ms",
            "cpu",
            body,
            notes,
            args.record,
        )


if __name__ == "__main__":
    main()
