"""Early exits on many ranks, repeated: a refusal that one side makes before training, and the same
command again on a finished run, each launched N times through the plain ``deepspeed`` command on 2
and 3 ranks, colocated and split (1 rollout rank).

    python benchmarks/refusals.py [--repeats 5] [--record]

For each launch: the exit code each rank recorded (the ranks record it where GRPO_DS_LAUNCH_EXITS
says, as under ``python -m grpo_ds.launch``), the number of ``error:`` lines, and whether a
traceback or C++ frames were printed. The refusals:
- key: the run folder holds a run of another recipe (refused by the trainer's rank 0 before any
  model loads);
- trainer: the LoRA adapters have no module to go on (refused by every trainer rank as the policy
  is built, after the rollout ranks have started loading);
- rollout: the reward functions cannot be loaded in a fresh process (refused by the rank that
  scores: the trainer's rank 0 colocated, the rollout rank under split placement);
and ``finished``: the same command on a finished run ends at once. Expected: every rank exits 2 with
exactly one ``error:`` line and nothing else (0 and one "nothing to do" for ``finished``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import markdown_table, report  # noqa: E402
from grpo_ds.distributed.launcher import EXITS_VAR, free_port, recorded_exits  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny_cpu.json"
ARGS = [
    "train.steps=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "train.micro_batch_samples_per_gpu=4",
    "logging.progress_bar=false",
]
SPLIT = ['rollout.placement="split"', "rollout.ranks=1"]
WORKER_ONLY_FAILS = """
import __main__
from grpo_ds.rewards.builtin import exact_match as _exact_match

if getattr(getattr(__main__, "__spec__", None), "name", "") == "grpo_ds.rewards.worker":
    raise ImportError("this module cannot be loaded in a fresh process")


def exact_match(**kwargs):
    return _exact_match(**kwargs)
"""
KINDS = {
    "key": ["algorithm.rollout_is_cap=2.0"],
    "trainer": ["model.lora_rank=4", 'model.lora_target_modules=["nonexistent_proj"]'],
    "rollout": ['reward.functions=[{"name": "worker_only_fails:exact_match"}]'],
    "finished": [],
}
CPP_FRAMES = ("frame #", "terminate called", "C++ CapturedTraceback")


def launch(ranks: int, args: list[str], work: Path) -> dict:
    """One launch: its exit code, the ranks' recorded codes, what it printed, its seconds."""
    port = free_port()
    exits = Path(tempfile.mkdtemp(dir=work))
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": f"{work}{os.pathsep}{REPO}",
        EXITS_VAR: str(exits),
    }
    deepspeed = Path(sys.executable).parent / "deepspeed"
    started = time.monotonic()
    done = subprocess.run(
        [str(deepspeed), "--num_gpus", str(ranks), "--master_port", str(port)]
        + ["--module", "grpo_ds.train", str(TINY), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.monotonic() - started
    for leftover in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
        leftover.unlink(missing_ok=True)
    output = done.stdout + done.stderr
    recorded = recorded_exits(exits)
    return {
        "code": done.returncode,
        "ranks": [recorded.get(r) for r in range(ranks)],
        "errors": sum("error: " in line for line in output.splitlines()),
        "nothing to do": output.count("nothing to do"),
        "traceback": "Traceback" in output,
        "c++": any(frame in output for frame in CPP_FRAMES),
        "seconds": seconds,
    }


def expected(kind: str, result: dict) -> bool:
    if kind == "finished":
        return set(result["ranks"]) == {0} and result["nothing to do"] == 1
    return (
        set(result["ranks"]) == {2}
        and result["errors"] == 1
        and not result["traceback"]
        and not result["c++"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "worker_only_fails.py").write_text(WORKER_ONLY_FAILS)
        for ranks in (2, 3):
            for placement in ("colocated", "split"):
                layout = SPLIT if placement == "split" else []
                out = work / f"{ranks}-{placement}"
                base = [f"run.output_dir={out}", *ARGS, *layout]
                first = launch(ranks, base, work)
                assert set(first["ranks"]) == {0}, f"the finished run failed: {first}"
                for kind, extra in KINDS.items():
                    results = []
                    for repeat in range(args.repeats):
                        fresh = kind in ("trainer", "rollout")
                        where = [f"run.output_dir={out}-{kind}-{repeat}"] if fresh else []
                        results.append(launch(ranks, [*base, *where, *extra], work))
                    held = sum(expected(kind, r) for r in results)
                    codes = sorted({code for r in results for code in r["ranks"]}, key=str)
                    rows.append(
                        [
                            ranks,
                            placement,
                            kind,
                            f"{held} of {len(results)}",
                            ", ".join(map(str, codes)),
                            ", ".join(str(r["errors"]) for r in results),
                            sum(r["traceback"] or r["c++"] for r in results),
                            f"{max(r['seconds'] for r in results):.1f}",
                        ]
                    )
                    print(rows[-1], flush=True)
    all_held = all(row[3] == f"{args.repeats} of {args.repeats}" for row in rows)
    body = markdown_table(
        [
            "ranks",
            "placement",
            "exit",
            "as expected",
            "ranks' codes",
            "error: lines a launch",
            "launches with a traceback or C++ frames",
            "slowest launch (s)",
        ],
        rows,
    )
    notes = [
        "each launch: `deepspeed --num_gpus N --module grpo_ds.train recipes/tiny_cpu.json` (2 "
        "steps, 4 prompts x 4 samples); split: 1 rollout rank",
        "as expected: every rank recorded 2 with exactly one `error:` line and no traceback or C++ "
        'frames (finished: every rank 0 and one "nothing to do")',
        f"target (every launch as expected): {'met' if all_held else 'NOT met'}",
    ]
    report("refusals", f"{args.repeats} launches each", "cpu", body, notes, args.record)


if __name__ == "__main__":
    main()
