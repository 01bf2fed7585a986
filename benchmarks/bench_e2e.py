"""One end-to-end grpo_ds run through its command line, measured: does it train, and where do time
and memory go?

    python benchmarks/bench_e2e.py --device cuda --record          # a random Qwen2.5-0.5B-shaped
        model, bf16, 1 GPU
    python benchmarks/bench_e2e.py --device cpu --shape realistic  # bench_vs_trl's realistic shape
        on the CPU

The random model folder is built from a config in code (bench_vs_trl's shapes, the builtin character
tokenizer beside it). ``python -m grpo_ds.train`` then runs an inline recipe on it as a user would:
one process, DeepSpeed (the stage-3 file, which one rank runs as stage 1), the hf engine generating
with the policy's own module, kernels.backend "auto" (Triton on CUDA) and the fused lm_head. A
random model never gives a right answer, so exact_match would score every completion 0, leave every
advantage 0 and move no weight: the reward here is the share of even token ids in a completion
(``even_tokens``), which differs between the completions of a group. Afterwards the run folder is
read: every step's loss and gradient norm must be finite, and the saved final model's weights are
compared with the initial ones (how many tensors moved, and by how much). The table gives each
step's per-phase seconds, tokens/s and peak memory (allocated GPU memory on CUDA, the resident set
on the CPU). Exits 1 when the run fails, a loss is not finite or no weight moved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    # measure this checkout's grpo_ds, whatever copy pip has installed
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from bench_vs_trl import SHAPES, build_qwen2_folder, model_description  # noqa: E402
from common import fmt, markdown_table, report  # noqa: E402

from grpo_ds.run.metrics import read_metrics  # noqa: E402

DEFAULT_SHAPE = {"cuda": "qwen2-0.5b", "cpu": "realistic"}
# this module, on PYTHONPATH
REWARD = {"functions": [{"name": "bench_e2e:even_tokens", "weight": 1.0}]}


def even_tokens(*, completion_ids: list[list[int]], **columns) -> list[float]:
    """The share of even token ids in each completion: a reward a random model's samples differ
    in."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


PHASES = ("rollout", "reward", "logprob", "update", "sync")


def run_training(recipe_path: Path, device: str, log: Path) -> None:
    path = os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # native kernels on CUDA; the torch path on the CPU
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "grpo_ds.train", str(recipe_path)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode:
        print(log.read_text()[-6000:])
        raise SystemExit(f"grpo_ds.train exited {proc.returncode}")


def weight_change(initial: Path, final: Path) -> tuple[int, int, float]:
    """(tensors that changed, tensors compared, largest absolute change) between two saved model
    folders."""
    from safetensors.torch import load_file

    def state(folder: Path) -> dict[str, torch.Tensor]:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    before, after = state(initial), state(final)
    names = sorted(before.keys() & after.keys())
    deltas = [(after[n].float() - before[n].float()).abs().max().item() for n in names]
    return sum(d > 0 for d in deltas), len(names), max(deltas, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--shape", choices=[s for s, v in SHAPES.items() if v.model], default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    shape_name = args.shape or DEFAULT_SHAPE[args.device]
    shape = SHAPES[shape_name]
    work = Path(tempfile.mkdtemp(prefix="grpo_ds-e2e-"))
    parameters = build_qwen2_folder(work / "model", shape, args.seed)
    recipe = {
        **shape.recipe,
        "model": {**shape.recipe["model"], "path": str(work / "model")},
        "reward": REWARD,
        "run": {
            "name": "e2e",
            "output_dir": str(work / "runs"),
            "seed": args.seed,
            "save_final_model": True,
        },
        # lr 1e-4, not the shape's 1e-6: an Adam step moves a weight by about lr, and a bf16 weight
        # of 0.02 changes only by steps of 8e-5 (the saved final model would show no move at 1e-6)
        "train": {**shape.recipe["train"], "steps": args.steps, "lr": 1e-4},
        "checkpoint": {"every_steps": None},
        "logging": {"progress_bar": False, "samples_every_steps": None},
        "deepspeed": str(REPO / "ds_configs" / "zero3.json"),
    }
    (work / "recipe.json").write_text(json.dumps(recipe, indent=1))
    run_training(work / "recipe.json", args.device, work / "train.log")
    run_dir = work / "runs" / "e2e"
    metrics = read_metrics(run_dir)
    changed, compared, largest = weight_change(work / "model", run_dir / "final_model")
    finite = all(
        math.isfinite(m["loss"]) and math.isfinite(m.get("grad_norm", 0.0)) for m in metrics
    )

    headers = [
        "step",
        "loss",
        "reward",
        "grad norm",
        *[f"{p} s" for p in PHASES],
        "step s",
        "train tokens/s",
        "generated tokens/s",
        "peak GiB",
    ]
    rows = [
        [
            m["step"],
            f"{m['loss']:.4g}",
            fmt(m["reward_mean"], 3),
            f"{m['grad_norm']:.3g}",
            *[fmt(m.get(f"time_{p}_s"), 3) for p in PHASES],
            fmt(m["time_step_s"], 3),
            fmt(m["tokens_per_s"], 0),
            fmt(m["generated_tokens_per_s"], 0),
            fmt(m["peak_memory_gib"], 2),
        ]
        for m in metrics
    ]
    later = metrics[1:] or metrics  # the first step warms up (Triton compiles, the allocator grows)
    notes = [
        f"model: {model_description(shape, parameters)}; {shape.about}",
        f"trains: {'every loss and gradient norm finite' if finite else 'NOT every loss finite'}; "
        f"{changed} of {compared} weight tensors moved (largest change {largest:.3g}) from the "
        "initial model to final_model",
        "after the first step (median): "
        + ", ".join(
            f"{p} {sorted(m[f'time_{p}_s'] for m in later)[len(later) // 2]:.3f} s"
            for p in PHASES
            if f"time_{p}_s" in later[0]
        ),
        "peak GiB: metrics.jsonl's peak_memory_gib (allocated "
        "GPU memory on CUDA, the process's resident set on CPU)",
        "the run: python -m grpo_ds.train on the inline "
        "recipe below, one process, through DeepSpeed",
        "recipe: `"
        + json.dumps({k: v for k, v in recipe.items() if k not in ("run",)})
        .replace(str(work), "TMP")
        .replace(str(REPO) + "/", "")
        + "`",
    ]
    report(
        "grpo_ds end to end",
        f"{shape_name}, {args.steps} steps",
        args.device,
        markdown_table(headers, rows),
        notes,
        args.record,
    )
    if not finite or not changed:
        raise SystemExit(
            "the run did not train: " + ("a non-finite loss" if not finite else "no weight moved")
        )


if __name__ == "__main__":
    main()
