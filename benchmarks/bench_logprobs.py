"""Benchmark grpo_ds.kernels.logprobs_from_logits (grpo_ds/kernels/logprobs.py, chunked path in
chunked.py).

Input: logits (N, V) in --dtype, all N rows scored. Two ops (--op):
    logprobs  per-token log-prob and entropy (N,); backward with fixed random upstream gradients
    loss      the same, then the per-token policy loss of grpo_ds.algo.policy_loss.token_losses (PPO
              clip 0.2 / 0.28, k3 KL 0.04, entropy bonus --entropy-coef) summed with weights 1/N;
              backward to the logits
Variants:
    eager          naive PyTorch: log_softmax of the whole (N, V) in float32, gather, -(p *
                   logp).sum(-1)
    chunked/<c>    backend "torch", chunk_tokens = c (--chunk-tokens takes a comma list)
    triton         backend "triton" (CUDA; on CPU only under TRITON_INTERPRET=1)
Peak extra memory counts everything beyond the inputs, the logits' gradient (N x V in --dtype)
included. --bandwidth adds the achieved bandwidth, minimum bytes moved / time (forward reads the
logits once, backward reads them and writes their gradient), as a percentage of the device's
measured copy bandwidth.

--sweep (instead of the variants) times the Triton row kernels' launch (token_math.Launch: block_v x
num_warps, --sweep-blocks / --sweep-warps) at the given shape, forward and backward, each with its
share of the copy bandwidth, and prints one table (well under a minute at the GPU shapes):
    python benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --sweep --record

GPU, every benchmark at the GPU shapes, one command:  bash benchmarks/run_gpu.sh
CPU peak memory at 4,096 x 151,936 (fp32 logits), with the fused-linear one:  bash
benchmarks/run_cpu_memory.sh which runs
    python benchmarks/bench_logprobs.py --device cpu --tokens 4096 --vocab 151936 --op loss --mode
        full \\
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
    markdown_table,
    median_ms,
    naive_logprobs_entropy,
    report,
    run,
    select,
    table,
    verdict,
    weighted_loss,
)

from grpo_ds.kernels import logprobs_from_logits
from grpo_ds.kernels.token_math import Launch

PASSES = {"forward": 1, "backward": 2, "full": 3}  # reads + writes of an (N, V) tensor per mode


def variant_names(args: argparse.Namespace) -> list[str]:
    names = ["eager"]
    for backend in kernel_backends(args):
        names += [f"chunked/{c}" for c in args.chunk_tokens] if backend == "torch" else ["triton"]
    return select(names, args)


def setup(args: argparse.Namespace) -> Case:
    n, v, device = args.tokens, args.vocab, args.device
    # (N, V)
    logits = torch.randn(n, v, device=device, dtype=DTYPES[args.dtype]).requires_grad_(True)
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
        variants[f"chunked/{c}"] = lambda c=c: finish(
            *logprobs_from_logits(
                logits, targets, temperature=temperature, chunk_tokens=c, backend="torch"
            )
        )
    variants["triton"] = lambda: finish(
        *logprobs_from_logits(logits, targets, temperature=temperature, backend="triton")
    )
    return Case(variants, leaves=(logits,))


def sweep(args: argparse.Namespace) -> None:
    """The --sweep table: rows_forward and rows_backward (grpo_ds/kernels/logprobs.py) for each
    launch."""
    from grpo_ds.kernels.logprobs import rows_backward, rows_forward

    n, v, device = args.tokens, args.vocab, args.device
    torch.manual_seed(args.seed)
    logits = torch.randn(n, v, device=device, dtype=DTYPES[args.dtype])  # (N, V)
    grad = torch.empty_like(logits)
    rows, targets = torch.arange(n, device=device), torch.randint(0, v, (n,), device=device)
    g_logprob, g_entropy = torch.randn(n, device=device) / n, torch.randn(n, device=device) / n
    _, entropy, lse = rows_forward(logits, rows, targets, args.temperature)
    copy_bw = copy_bandwidth(device)
    logits_bytes = n * v * logits.element_size()
    table_rows: list[list[str]] = []
    best: dict[str, tuple[float, str]] = {}
    for mode in ("forward", "backward"):
        for block_v in args.sweep_blocks:
            for warps in args.sweep_warps:
                launch = Launch(block_v, warps)
                fn = (
                    (
                        lambda launch=launch: rows_forward(
                            logits, rows, targets, args.temperature, launch
                        )
                    )
                    if mode == "forward"
                    else (
                        lambda launch=launch: rows_backward(
                            logits,
                            rows,
                            targets,
                            args.temperature,
                            lse,
                            entropy,
                            g_logprob,
                            g_entropy,
                            grad,
                            launch,
                        )
                    )
                )
                try:
                    ms = median_ms(fn, device, warmup=args.warmup, repeats=args.repeats)
                except Exception as e:  # noqa: BLE001 - a launch that cannot run is a row, not the end
                    table_rows.append(
                        [mode, launch.name(), f"failed: {type(e).__name__}: {str(e)[:80]}", "", ""]
                    )
                    continue
                rate = PASSES[mode] * logits_bytes / (ms / 1e3)
                pct = 100 * rate / copy_bw
                table_rows.append(
                    [mode, launch.name(), fmt(ms, 3), fmt(rate / 1e9, 0), fmt(pct, 0)]
                )
                print(" | ".join(table_rows[-1]), flush=True)
                if pct > best.get(mode, (-1.0, ""))[0]:
                    best[mode] = (pct, launch.name())
    default = Launch().name() + f" (= block_v {Launch().options(v)['BLOCK_V']}, 4 warps)"
    notes = [
        f"time: median of {args.repeats} after {args.warmup} warm-up runs (CUDA events on the "
        "GPU); one compile per launch, outside the timing",
        f"copy bandwidth (dst.copy_(src), 1 GiB, read + written): {copy_bw / 1e9:,.0f} GB/s; bytes "
        f"moved: forward 1 x N x V x {logits.element_size()} "
        f"B, backward 2 x N x V x {logits.element_size()} B",
        f"default launch: {default}",
        *[
            f"best {mode}: {name}, {pct:.0f}% of copy bandwidth"
            + (f" (target >= 60%): {verdict(pct >= 60)}" if mode == "forward" else "")
            for mode, (pct, name) in best.items()
        ],
    ]
    shape = f"sweep, {n:,} tokens x vocab {v:,}, {args.dtype}, {device}"
    report(
        "bench_logprobs",
        shape,
        device,
        markdown_table(["pass", "launch", "time ms", "GB/s", "% of copy"], table_rows),
        notes,
        args.record,
    )


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=16384, help="N, rows of logits")
    parser.add_argument("--vocab", type=int, default=151936, help="V")
    parser.add_argument("--op", choices=("logprobs", "loss"), default="loss")
    parser.add_argument(
        "--chunk-tokens",
        type=int_list,
        default=[1024],
        help="chunked path chunk sizes, e.g. 1024,256",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--entropy-coef", type=float, default=1e-3, help="entropy bonus of the loss op"
    )
    parser.set_defaults(small={"tokens": 64, "vocab": 1000})
    parser.add_argument(
        "--bandwidth", action="store_true", help="add achieved bandwidth as %% of copy bandwidth"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="time the Triton kernels' launches (see above) instead"
    )
    parser.add_argument(
        "--sweep-blocks",
        type=int_list,
        default=[2048, 4096, 8192, 16384],
        help="--sweep's block_v values",
    )
    parser.add_argument(
        "--sweep-warps", type=int_list, default=[4, 8, 16], help="--sweep's num_warps values"
    )
    args = finish_args(parser.parse_args())
    if args.sweep:
        # the cuda defaults: a shorter timer, to stay under a minute
        if args.warmup == 3 and args.repeats == 20:
            args.warmup, args.repeats = 2, 10
        return sweep(args)
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
        notes.append(
            f"copy bandwidth (dst.copy_(src), 1 GiB, read + written): {copy_bw / 1e9:,.0f} GB/s; "
            "bytes moved per mode: "
            f"{', '.join(f'{k} {p} x N x V x {elt} B' for k, p in PASSES.items())}"
        )
        for m in results:
            if m.variant == "triton" and m.ms and args.device == "cuda":
                pct = 100 * achieved(m) / copy_bw
                notes.append(
                    f"triton {m.mode}: {pct:.0f}% of copy bandwidth "
                    f"(target >= 60%): {verdict(pct >= 60)}"
                )
    notes.append(
        "the logits and their gradient are "
        f"{logits_bytes / MIB:,.0f} MiB each; one float32 chunk of "
        + ", ".join(f"{c} rows is {c * args.vocab * 4 / MIB:,.0f} MiB" for c in args.chunk_tokens)
    )
    for mode in args.modes:
        fit = chunk_fit(
            results,
            "chunked",
            mode,
            lambda m: int(m.variant.split("/")[1]) * args.vocab * 4 / MIB,
            lambda m: m.peak_mib,
        )
        if fit:
            notes.append(fit)
    by_key = {(m.variant, m.mode): m for m in results}
    for m in results:
        eager = by_key.get(("eager", m.mode))
        if m.variant.startswith("chunked/") and m.peak_mib is not None and eager and eager.peak_mib:
            r = m.peak_mib / eager.peak_mib
            notes.append(
                f"{m.variant} {m.mode}: extra memory {r:.3f} of eager's (target <= 0.25): "
                f"{verdict(r <= 0.25)}"
            )

    shape = (
        f"op {args.op}, {args.tokens:,} tokens x vocab {args.vocab:,}, {args.dtype}, {args.device}"
    )
    report("bench_logprobs", shape, args.device, table(results, extra=extra), notes, args.record)


if __name__ == "__main__":
    main()
