"""What replaying the sampler's top-k / top-p set costs the log-prob kernels
(grpo_ds/kernels/support.py).

    python benchmarks/bench_support.py [--device cpu|cuda] [--tokens N] [--vocab V] [--hidden H]
        [--record]

For each path of the per-token math, the log-probs and entropy of N tokens over a V-token vocabulary
are computed untruncated and over the sampler's set (--top-k / --top-p, default 20 and 0.9, then
each alone), side by side in one run: the variants of a path take turns, repeat by repeat, so a
machine whose load changes slows them alike.

    logits  kernels.logprobs_from_logits on (N, V) logits (the full-logits path,
            kernels.fused_lm_head false)
    hidden  kernels.logprobs_from_hidden on (N, H) hidden states and the (V, H) lm_head (the default
            path)

Modes: "forward" is the log-prob pass (old and reference log-probs: no gradient); "full" is the
training forward and backward. The backend is the device's (torch on a CPU, Triton on CUDA). The
logits are spread like a language model's (std --logit-std, 5 by default: top_p 0.9 keeps about a
hundred of 151,936 tokens, a few hundred at most; a flatter spread sends more rows to the full-row
sort, grpo_ds.kernels.support's fallback, which the notes count). The target (issue 49): the
truncated log-prob pass at most 1.3x the untruncated one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from common import DTYPES, fmt, markdown_table, report, verdict  # noqa: E402

from grpo_ds import kernels  # noqa: E402
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation  # noqa: E402
from grpo_ds.config.software import resolve_backend  # noqa: E402
from grpo_ds.kernels import support  # noqa: E402

TARGET = 1.3  # the truncated log-prob pass over the untruncated one


def _time(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def _run(
    path: str,
    inputs: dict,
    truncation: Truncation,
    mode: str,
    args: argparse.Namespace,
    backend: str,
):
    """A closure running one variant once: forward under no_grad, or forward and backward."""

    def fn():
        with torch.set_grad_enabled(mode == "full"):
            if path == "logits":
                logprob, entropy = kernels.logprobs_from_logits(
                    inputs["logits"],
                    inputs["targets"],
                    None,
                    args.temperature,
                    args.chunk_tokens,
                    backend,
                    truncation,
                )
            else:
                logprob, entropy = kernels.logprobs_from_hidden(
                    inputs["hidden"],
                    inputs["weight"],
                    inputs["targets"],
                    args.temperature,
                    args.chunk_tokens,
                    backend,
                    truncation,
                )
            if mode == "full":
                (logprob.sum() + 0.1 * entropy.sum()).backward()

    return fn


def _inputs(path: str, args: argparse.Namespace) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    dtype, n, v, h = DTYPES[args.dtype], args.tokens, args.vocab, args.hidden
    out = {"targets": torch.randint(0, v, (n,), generator=gen).to(args.device)}
    if path == "logits":
        out["logits"] = (
            (args.logit_std * torch.randn(n, v, generator=gen))
            .to(args.device, dtype)
            .requires_grad_()
        )
    else:
        out["hidden"] = torch.randn(n, h, generator=gen).to(args.device, dtype).requires_grad_()
        weight = args.logit_std / h**0.5 * torch.randn(v, h, generator=gen)
        out["weight"] = weight.to(args.device, dtype).requires_grad_()
    return out


def _fallback_rows(
    path: str, inputs: dict, truncation: Truncation, args: argparse.Namespace
) -> tuple[int, int]:
    """(rows whose candidates could not decide the top-p cut, rows) over one chunk: the rows a run
    sorts whole."""
    with torch.no_grad():
        if path == "logits":
            logits = inputs["logits"][: args.chunk_tokens]
        else:
            logits = inputs["hidden"][: args.chunk_tokens] @ inputs["weight"].t()
        sorted_rows = []
        real = torch.Tensor.sort

        def sort(self, *a, **k):
            sorted_rows.append(self.shape[0])
            return real(self, *a, **k)

        torch.Tensor.sort = sort
        try:
            support.thresholds(logits, args.temperature, truncation)
        finally:
            torch.Tensor.sort = real
    return sum(sorted_rows), logits.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="N (default 1,024 on cpu, 16,384 on cuda)"
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--hidden", type=int, default=None, help="H (default 896 on cpu, 4,096 on cuda)"
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="tokens per chunk (default 256 cpu, 1024 cuda)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--logit-std", type=float, default=5.0)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--paths", default="logits,hidden")
    parser.add_argument("--modes", default="forward,full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.tokens = args.tokens or (16384 if gpu else 1024)
    args.hidden = args.hidden or (4096 if gpu else 896)
    args.chunk_tokens = args.chunk_tokens or (1024 if gpu else 256)
    backend = resolve_backend("auto", args.device)
    variants = {
        "untruncated": NO_TRUNCATION,
        f"top_k {args.top_k}, top_p {args.top_p:g}": Truncation(args.top_k, args.top_p),
        f"top_k {args.top_k}": Truncation(top_k=args.top_k),
        f"top_p {args.top_p:g}": Truncation(top_p=args.top_p),
    }
    rows, notes, ratios = [], [], {}
    for path in args.paths.split(","):
        inputs = _inputs(path, args)
        for mode in args.modes.split(","):
            fns = {name: _run(path, inputs, t, mode, args, backend) for name, t in variants.items()}
            for fn in fns.values():  # warm-up: one untimed run each
                fn()
            times = {name: [] for name in fns}
            for _ in range(args.repeats):  # the variants take turns
                for name, fn in fns.items():
                    for leaf in (t for t in inputs.values() if t.requires_grad):
                        leaf.grad = None
                    times[name].append(_time(fn, args.device))
            base = statistics.median(times["untruncated"])
            for name, values in times.items():
                ms = statistics.median(values)
                ratios[path, mode, name] = ms / base
                rows.append([path, mode, name, fmt(ms, 1), fmt(ms / base, 2) + "x"])
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        fallback, chunk = _fallback_rows(path, inputs, Truncation(top_p=args.top_p), args)
        notes.append(
            f"{path}: top_p {args.top_p:g} alone sorted {fallback} of {chunk} rows of a chunk "
            "whole (the rows whose 1,024 largest logits hold less than top_p of the mass)"
        )
        del inputs
    pair = f"top_k {args.top_k}, top_p {args.top_p:g}"
    for path in args.paths.split(","):
        if (path, "forward", pair) in ratios:
            r = ratios[path, "forward", pair]
            notes.append(
                f"target ({path}): the log-prob pass with {pair} at most {TARGET}x the untruncated "
                f"one: {r:.2f}x, {verdict(r <= TARGET)}"
            )
    notes += [
        f"time: median of {args.repeats} after one warm-up run, the variants of a path and mode in "
        f"turn, perf_counter{' around CUDA synchronisations' if gpu else ''}",
        f"backend {backend}; chunks of {args.chunk_tokens} tokens; logits std {args.logit_std:g}, "
        f"temperature {args.temperature:g}",
    ]
    shape = (
        f"{args.tokens:,} tokens x vocab {args.vocab:,} (hidden {args.hidden:,}), {args.dtype}, "
        f"{args.device}"
    )
    report(
        "bench_support",
        shape,
        args.device,
        markdown_table(["path", "mode", "sampler's set", "time ms", "vs untruncated"], rows),
        notes,
        args.record,
    )


if __name__ == "__main__":
    main()
