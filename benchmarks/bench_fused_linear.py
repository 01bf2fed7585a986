"""Benchmark grpo_ds.kernels.policy_loss_from_hidden (grpo_ds/kernels/fused_linear.py, chunked path in chunked.py).

Input: hidden states (N, H) and the lm_head weight (V, H) in --dtype, N = B sequences x --seq-len tokens; output:
the policy loss sum_t w_t l_t with w_t = 1/N (token mean), l_t = PPO clip 0.2 / 0.28 + k3 KL 0.04 (no entropy
bonus by default: Liger's loss has none), and its gradients w.r.t. hidden and weight.
Variants:
    eager        logits = hidden @ weight.T (N, V), then the naive PyTorch path: float32 log_softmax, gather,
                 -(p * logp).sum(-1), grpo_ds.algo.policy_loss.token_losses, weighted sum
    chunked/<c>  backend "torch", chunk_tokens = c (--chunk-tokens takes a comma list)
    triton/<c>   backend "triton" (CUDA; on CPU only under TRITON_INTERPRET=1); computes the gradients in the
                 forward pass, so its "forward" includes them and its "backward" only scales them
    liger        Liger-Kernel's LigerFusedLinearGRPOLoss, when liger_kernel is importable, same loss
                 (loss_type "bnpo" = token mean, beta 0.04, epsilon_low 0.2, epsilon_high 0.28), chunk_size =
                 first --chunk-tokens / --seq-len sequences
Peak extra memory counts everything beyond the inputs, the gradients of hidden and weight included. With memory
measured the notes say how much each chunked variant holds beyond those gradients, in units of one chunk of
float32 logits, against the size of the full logits.

GPU, every benchmark at the GPU shapes, one command:  bash benchmarks/run_gpu.sh
CPU peak memory at 4,096 tokens x hidden 896 x vocab 151,936 (fp32), with the logits one:
bash benchmarks/run_cpu_memory.sh, which runs
    python benchmarks/bench_fused_linear.py --device cpu --tokens 4096 --seq-len 1024 --hidden 896 \\
        --vocab 151936 --mode full --memory --chunk-tokens 1024,256 --record
"""

from __future__ import annotations

import argparse
import importlib.util
import math

import torch
from common import (
    DTYPES,
    MIB,
    Case,
    Measurement,
    base_parser,
    chunk_fit,
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

from grpo_ds.kernels import LossInputs, policy_loss_from_hidden


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def variant_names(args: argparse.Namespace) -> list[str]:
    names = ["eager"]
    for backend in kernel_backends(args):
        names += [f"{'chunked' if backend == 'torch' else 'triton'}/{c}" for c in args.chunk_tokens]
    if liger_available():
        names.append("liger")
    return select(names, args)


def setup(args: argparse.Namespace) -> Case:
    n, h, v, seq, device, dtype = args.tokens, args.hidden, args.vocab, args.seq_len, args.device, DTYPES[args.dtype]
    b = n // seq
    hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True)  # (N, H)
    weight = torch.randn(v, h, device=device, dtype=dtype).div_(math.sqrt(h)).requires_grad_(True)  # (V, H)
    targets = torch.randint(0, v, (n,), device=device)  # (N,)
    typical = -math.log(v) - 0.5  # log-prob of a token under softmax of standard normal logits
    old = typical + 0.1 * torch.randn(n, device=device)  # (N,)
    ref = typical + 0.1 * torch.randn(n, device=device)  # (N,)
    seq_advantages = torch.randn(b, device=device)  # (B,)
    advantages = seq_advantages.repeat_interleave(seq)  # (N,) every token of a sequence shares its advantage
    weights = torch.full((n,), 1.0 / n, device=device)  # (N,) token mean
    cfg = loss_config(args.entropy_coef)
    temperature = args.temperature
    inputs = LossInputs(targets, advantages, weights, old, ref)

    def eager() -> torch.Tensor:
        logits = hidden @ weight.t()  # (N, V)
        logprob, entropy = naive_logprobs_entropy(logits, targets, temperature)
        return weighted_loss(logprob, entropy, old, ref, advantages, weights, cfg)

    variants = {"eager": eager}
    for c in args.chunk_tokens:
        for name, backend in (("chunked", "torch"), ("triton", "triton")):
            variants[f"{name}/{c}"] = lambda c=c, backend=backend: policy_loss_from_hidden(
                hidden, weight, inputs, cfg, temperature, c, backend).loss
    if liger_available():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=cfg.kl_coef, compiled=args.liger_compiled, use_ref_model=True,
                                         chunk_size=max(1, args.chunk_tokens[0] // seq), epsilon_low=cfg.clip_low,
                                         epsilon_high=cfg.clip_high, loss_type="bnpo", temperature=temperature)
        mask = torch.ones(b, seq, device=device, dtype=torch.long)  # (B, T)
        variants["liger"] = lambda: liger(
            _input=hidden.view(b, seq, h), lin_weight=weight, selected_token_ids=targets.view(b, seq),
            attention_mask=mask, advantages=seq_advantages, ref_per_token_logps=ref.view(b, seq),
            old_per_token_logps=old.view(b, seq))[0]
    return Case(variants, leaves=(hidden, weight))


def chunk_of(name: str) -> int | None:
    head, _, tail = name.partition("/")
    return int(tail) if head in ("chunked", "triton") and tail else None


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=16384, help="N = sequences x --seq-len")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (Liger takes (B, T, H))")
    parser.add_argument("--hidden", type=int, default=4096, help="H")
    parser.add_argument("--vocab", type=int, default=151936, help="V")
    parser.add_argument("--chunk-tokens", type=int_list, default=[1024], help="chunk sizes, e.g. 1024,256")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus (Liger has none)")
    parser.add_argument("--liger-compiled", type=int, choices=(0, 1), default=None,
                        help="Liger's torch.compile of the loss math (default: 1 on cuda, 0 on cpu)")
    parser.set_defaults(small={"tokens": 64, "seq_len": 32, "hidden": 64, "vocab": 1000})
    args = finish_args(parser.parse_args())
    if args.tokens % args.seq_len:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")
    if args.liger_compiled is None:
        args.liger_compiled = int(args.device == "cuda")
    names = variant_names(args)
    results, notes = run(setup, names, args)

    elt = DTYPES[args.dtype].itemsize
    full_logits = args.tokens * args.vocab * elt / MIB
    grads = (args.tokens + args.vocab) * args.hidden * elt / MIB  # gradients of hidden and weight

    def chunk_mib(m: Measurement) -> float | None:
        c = chunk_of(m.variant)
        return c * args.vocab * 4 / MIB if c else None  # one chunk of logits in float32

    def held(m: Measurement) -> float:  # beyond the inputs' gradients (none in forward mode)
        return m.peak_mib - (grads if m.mode != "forward" else 0.0)

    extra = {}
    if any(m.peak_mib is not None for m in results):
        extra["beyond grads MiB"] = lambda m: fmt(held(m) if m.peak_mib is not None else None, 0)
        extra["in fp32 chunks"] = lambda m: fmt(held(m) / chunk_mib(m)
                                                if m.peak_mib is not None and chunk_mib(m) else None, 2)
        notes.append(f"full logits ({args.tokens:,} x {args.vocab:,} {args.dtype}): {full_logits:,.0f} MiB; gradients "
                     f"of hidden and weight: {grads:,.0f} MiB; one float32 chunk of logits: "
                     + ", ".join(f"{c:,} tokens {c * args.vocab * 4 / MIB:,.0f} MiB" for c in args.chunk_tokens))
        for m in results:
            if chunk_mib(m) and m.peak_mib is not None:
                notes.append(f"{m.variant} {m.mode}: holds {held(m):,.0f} MiB beyond the inputs and their gradients "
                             f"= {held(m) / chunk_mib(m):.2f} float32 chunks of logits; less than the full logits: "
                             f"{verdict(held(m) < full_logits)}")
        for prefix in ("chunked", "triton"):
            for mode in args.modes:
                fit = chunk_fit(results, prefix, mode, chunk_mib, held)
                if fit:
                    notes.append(fit + " (beyond the gradients)")
    by_key = {(m.variant, m.mode): m for m in results}
    for m in results:
        eager, liger = by_key.get(("eager", m.mode)), by_key.get(("liger", m.mode))
        if not m.variant.startswith("triton/") or m.mode != "full" or not m.ms or args.device != "cuda":
            continue
        if eager and eager.ms:
            s = eager.ms / m.ms
            notes.append(f"{m.variant} full: {s:.2f}x faster than eager (target >= 1.5x): {verdict(s >= 1.5)}")
        if liger and liger.ms:
            s = liger.ms / m.ms
            notes.append(f"{m.variant} full: {s:.2f}x faster than Liger (target >= 1.2x): {verdict(s >= 1.2)}")
        if liger and liger.peak_mib is not None and m.peak_mib is not None:
            notes.append(f"{m.variant} full: peak {m.peak_mib:,.0f} MiB vs Liger {liger.peak_mib:,.0f} MiB "
                         f"(target <= Liger): {verdict(m.peak_mib <= liger.peak_mib)}")
    if "liger" in names:
        notes.append(f"liger: chunk_size {max(1, args.chunk_tokens[0] // args.seq_len)} sequences, "
                     f"compiled={bool(args.liger_compiled)}")
    elif not liger_available():
        notes.append("liger: liger_kernel is not installed here (pip install liger-kernel), not measured")

    shape = (f"{args.tokens:,} tokens ({args.tokens // args.seq_len} x {args.seq_len}) x hidden {args.hidden:,} x "
             f"vocab {args.vocab:,}, {args.dtype}, {args.device}")
    report("bench_fused_linear", shape, args.device, table(results, references=("eager", "liger"), extra=extra),
           notes, args.record)


if __name__ == "__main__":
    main()
