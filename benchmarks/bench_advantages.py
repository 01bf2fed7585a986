"""Benchmark grpo_ds.kernels.group_advantages (grpo_ds/kernels/advantages.py): rewards (P*G,) ->
advantages.

Forward only (advantages carry no gradient).
Variants:
    eager    grpo_ds.algo.advantages.group_advantages (the reference, a chain of small PyTorch ops)
    triton   the one-launch Triton kernel (CUDA; on CPU only under TRITON_INTERPRET=1)
The kernels' "torch" backend is the reference itself, so it is not measured twice.

GPU, every benchmark at the GPU shapes, one command:  bash benchmarks/run_gpu.sh
"""

from __future__ import annotations

import argparse

import torch
from common import Case, base_parser, finish_args, kernel_backends, report, run, select, table

from grpo_ds.algo.advantages import group_advantages as reference_advantages
from grpo_ds.algo.names import BASELINES, SCALES
from grpo_ds.kernels import group_advantages


def variant_names(args: argparse.Namespace) -> list[str]:
    return select(["eager"] + [b for b in kernel_backends(args) if b == "triton"], args)


def setup(args: argparse.Namespace) -> Case:
    # (P*G,)
    rewards = torch.randint(0, 2, (args.prompts * args.group_size,), device=args.device).float()
    rewards += 0.1 * torch.rand_like(rewards)  # some groups all-correct / all-wrong, most mixed

    variants = {
        "eager": lambda: reference_advantages(rewards, args.group_size, args.baseline, args.scale),
        "triton": lambda: group_advantages(
            rewards, args.group_size, args.baseline, args.scale, backend="triton"
        ),
    }
    return Case(variants)


def main() -> None:
    parser = base_parser(__doc__, modes=("forward",))
    parser.add_argument("--prompts", type=int, default=1024, help="P")
    parser.add_argument("--group-size", type=int, default=16, help="G")
    parser.add_argument("--baseline", choices=BASELINES, default="group_mean")
    parser.add_argument("--scale", choices=SCALES, default="group")
    parser.set_defaults(small={"prompts": 4})
    args = parser.parse_args()
    if args.repeats is None and args.device == "cuda":
        args.repeats = 100  # microseconds per call: more samples for a stable median
    args = finish_args(args)
    args.dtype = "float32"
    results, notes = run(setup, variant_names(args), args)
    shape = (
        f"{args.prompts:,} prompts x {args.group_size} completions, baseline {args.baseline}, "
        f"scale {args.scale}, {args.device}"
    )
    report("bench_advantages", shape, args.device, table(results), notes, args.record)


if __name__ == "__main__":
    main()
