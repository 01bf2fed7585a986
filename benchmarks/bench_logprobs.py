"""Benchmark grpo_ds.kernels.logprobs_from_logits (grpo_ds/kernels/logprobs.py, chunked path in chunked.py).

Input: logits (N, V) in --dtype, all N rows scored. Two ops (--op):
    logprobs  per-token log-prob and entropy (N,); backward with fixed random upstream gradients
    loss      the same, then the per-token policy loss of grpo_ds.algo.policy_loss.token_losses (PPO clip
              0.2 / 0.28, k3 KL 0.04, entropy bonus --entropy-coef) summed with weights 1/N; backward to the logits
Variants:
    eager          naive PyTorch: log_softmax of the whole (N, V) in float32, gather, -(p * logp).sum(-1)
    chunked/<c>    backend "torch", chunk_tokens = c (--chunk-tokens takes a comma list)
    triton         backend "triton" (CUDA; on CPU only under TRITON_INTERPRET=1)
Peak extra memory counts everything beyond the inputs, the logits' gradient (N x V in --dtype) included.
--bandwidth adds the achieved bandwidth, minimum bytes moved / time (forward reads the logits once, backward
reads them and writes their gradient), as a percentage of the device's measured copy bandwidth.

GPU, every benchmark at the GPU shapes, one command:  bash benchmarks/run_gpu.sh
CPU peak memory at 4,096 x 151,936 (fp32 logits), with the fused-linear one:  bash benchmarks/run_cpu_memory.sh
which runs
    python benchmarks/bench_logprobs.py --device cpu --tokens 4096 --vocab 151936 --op loss --mode full \\
        --memory --chunk-tokens 1024,256,128 --record
"""

from __future__ import annotations

import argparse
import math

import torch
from common import (
    DTYPES,
    MIB,
    Case,
    Measurement,
    base_parser,
    chunk_fit,
    copy_bandwidth,
    finish_args,
    fmt,
    int_list,
    kernel_backends,
    loss_config,
    naive_logprobs_entropy,
    report,
    run,
    select,
    table,
    verdict,
    weighted_loss,
)

from grpo_ds.kernels import logprobs_from_logits

PASSES = {"forward": 1, "backward": 2, "full": 3}  # reads + writes of an (N, V) tensor per mode


def variant_names(args: argparse.Namespace) -> list[str]:
    names = ["eager"]
    for backend in kernel_backends(args):
        names += [f"chunked/{c}" for c in args.chunk_tokens] if backend == "torch" else ["triton"]
    return select(names, args)


def setup(args: argparse.Namespace) -> Case:
    n, v, device = args.tokens, args.vocab, args.device
    logits = torch.randn(n, v, device=device, dtype=DTYPES[args.dtype]).requires_grad_(True)  # (N, V)
    targets = torch.randint(0, v, (n,), device=device)  # (N,)
    typical = -math.log(v) - 0.5  # log-prob of a token under softmax of standard normal logits
    old = typical + 0.1 * torch.randn(n, device=device)  # (N,)
    ref = typical + 0.1 * torch.randn(n, device=device)  # (N,)
    advantages = torch.randn(n, device=device)  # (N,)
    weights = torch.full((n,), 1.0 / n, device=device)  # (N,) masked mean
    g_logprob, g_entropy = torch.randn(n, device=device) / n, torch.randn(n, device=device) / n
    cfg = loss_config(args.entropy_coef)
    temperature = args.temperature

    def finish(logprob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        if args.op == "loss":
            return weighted_loss(logprob, entropy, old, ref, advantages, weights, cfg)
        return (logprob * g_logprob).sum() + (entropy * g_entropy).sum()

    variants = {"eager": lambda: finish(*naive_logprobs_entropy(logits, targets, temperature))}
    for c in args.chunk_tokens:
        variants[f"chunked/{c}"] = lambda c=c: finish(*logprobs_from_logits(
            logits, targets, temperature=temperature, chunk_tokens=c, backend="torch"))
    variants["triton"] = lambda: finish(*logprobs_from_logits(logits, targets, temperature=temperature,
                                                              backend="triton"))
    return Case(variants, leaves=(logits,))


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=16384, help="N, rows of logits")
    parser.add_argument("--vocab", type=int, default=151936, help="V")
    parser.add_argument("--op", choices=("logprobs", "loss"), default="loss")
    parser.add_argument("--chunk-tokens", type=int_list, default=[1024], help="chunked path chunk sizes, e.g. 1024,256")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--entropy-coef", type=float, default=1e-3, help="entropy bonus of the loss op")
    parser.set_defaults(small={"tokens": 64, "vocab": 1000})
    parser.add_argument("--bandwidth", action="store_true", help="add achieved bandwidth as %% of copy bandwidth")
    args = finish_args(parser.parse_args())
    names = variant_names(args)
    elt = DTYPES[args.dtype].itemsize
    logits_bytes = args.tokens * args.vocab * elt
    copy_bw = copy_bandwidth(args.device) if args.bandwidth else None

    results, notes = run(setup, names, args)

    extra = {}
    if copy_bw:
        def achieved(m: Measurement) -> float | None:
            return PASSES[m.mode] * logits_bytes / (m.ms / 1e3) if m.ms else None

        extra["GB/s"] = lambda m: fmt(achieved(m) / 1e9 if achieved(m) else None, 0)
        extra["% of copy"] = lambda m: fmt(100 * achieved(m) / copy_bw if achieved(m) else None, 0)
        notes.append(f"copy bandwidth (dst.copy_(src), 1 GiB, read + written): {copy_bw / 1e9:,.0f} GB/s; "
                     f"bytes moved per mode: {', '.join(f'{k} {p} x N x V x {elt} B' for k, p in PASSES.items())}")
        for m in results:
            if m.variant == "triton" and m.ms and args.device == "cuda":
                pct = 100 * achieved(m) / copy_bw
                notes.append(f"triton {m.mode}: {pct:.0f}% of copy bandwidth (target >= 60%): {verdict(pct >= 60)}")
    notes.append(f"the logits and their gradient are {logits_bytes / MIB:,.0f} MiB each; one float32 chunk of "
                 + ", ".join(f"{c} rows is {c * args.vocab * 4 / MIB:,.0f} MiB" for c in args.chunk_tokens))
    for mode in args.modes:
        fit = chunk_fit(results, "chunked", mode, lambda m: int(m.variant.split("/")[1]) * args.vocab * 4 / MIB,
                        lambda m: m.peak_mib)
        if fit:
            notes.append(fit)
    by_key = {(m.variant, m.mode): m for m in results}
    for m in results:
        eager = by_key.get(("eager", m.mode))
        if m.variant.startswith("chunked/") and m.peak_mib is not None and eager and eager.peak_mib:
            r = m.peak_mib / eager.peak_mib
            notes.append(f"{m.variant} {m.mode}: extra memory {r:.3f} of eager's (target <= 0.25): "
                         f"{verdict(r <= 0.25)}")

    shape = f"op {args.op}, {args.tokens:,} tokens x vocab {args.vocab:,}, {args.dtype}, {args.device}"
    report("bench_logprobs", shape, args.device, table(results, extra=extra), notes,
           args.record)


if __name__ == "__main__":
    main()
