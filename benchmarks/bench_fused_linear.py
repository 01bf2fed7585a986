"""Benchmark grpo_ds.kernels.policy_loss_from_hidden (grpo_ds/kernels/fused_linear.py, chunked path
in chunked.py).

Input: hidden states (N, H) and the lm_head weight (V, H) in --dtype, N = B sequences x --seq-len
tokens; output: the policy loss sum_t w_t l_t with w_t = 1/N (token mean), l_t = PPO clip 0.2 /
0.28 + k3 KL 0.04 (no entropy bonus by default: Liger's loss has none), and its gradients w.r.t.
hidden and weight.
Variants:
    eager        logits = hidden @ weight.T (N, V), then the naive PyTorch path: float32
                 log_softmax, gather, -(p * logp).sum(-1), grpo_ds.algo.policy_loss.token_losses,
                 weighted sum
    chunked/<c>  backend "torch", chunk_tokens = c (--chunk-tokens takes a comma list)
    triton/<c>   backend "triton" (CUDA; on CPU only under TRITON_INTERPRET=1); computes the
                 gradients in the forward pass, so its "forward" includes them and its "backward"
                 only scales them
    liger        Liger-Kernel's LigerFusedLinearGRPOLoss, when liger_kernel is importable, same loss
                 (loss_type "bnpo" = token mean, beta 0.04, epsilon_low 0.2, epsilon_high 0.28),
                 chunk_size = first --chunk-tokens / --seq-len sequences; with --liger-compiled 1
                 its torch.compile is tried as it comes, then with dynamic=False, then with mode
                 "max-autotune-no-cudagraphs", then uncompiled, moving on when a call raises (torch
                 2.11 on an H200 failed the default with dynamo's
                 "sources must not be empty for symbol s37"); the notes say which ran
Peak extra memory counts everything beyond the inputs, the gradients of hidden and weight included.
With memory measured the notes say how much each chunked variant holds beyond those gradients, in
units of one chunk of float32 logits, against the size of the full logits.

--sweep (instead of the variants) times the Triton path's knobs at the given shape and prints one
table, so the defaults can be picked from a measurement (well under a minute at the GPU shapes on an
H100/H200):
    where the time goes, per chunk size (--sweep-chunks, default 1,024 / 2,048 / 4,096): the whole
        loss forward +
    backward; the forward without gradients (logits matmul + row kernel); the three chunk matmuls
        alone; the
    logits matmul alone; the weight-gradient sum alone (fp32 add of a bf16 product / addmm into fp32
        /
    bf16 addmm); the row kernel alone (with its gradient)
    the whole loss for each weight-gradient sum (FusedTuning.weight_grad_sum) and chunk size
    the row kernel for block_v x num_warps (token_math.Launch) on one chunk
plus eager PyTorch forward + backward, the 1.5x target's reference; a note per chunk size says the
most a chunked path that does the three matmuls can gain on eager (eager's time over theirs), so
whether the target is in reach is measured, not argued.
    python benchmarks/bench_fused_linear.py --device cuda --dtype bfloat16 --sweep --record

GPU, every benchmark at the GPU shapes, one command:  bash benchmarks/run_gpu.sh
CPU peak memory at 4,096 tokens x hidden 896 x vocab 151,936 (fp32), with the logits one:
bash benchmarks/run_cpu_memory.sh, which runs
    python benchmarks/bench_fused_linear.py --device cpu --tokens 4096 --seq-len 1024 --hidden 896
    \\
        --vocab 151936 --mode full --memory --chunk-tokens 1024,256 --record
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
from dataclasses import dataclass

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

from grpo_ds.algo.policy_loss import LossConfig
from grpo_ds.algo.truncation import NO_TRUNCATION
from grpo_ds.kernels import LossInputs, policy_loss_from_hidden
from grpo_ds.kernels.fused_linear import (
    WEIGHT_GRAD_SUMS,
    FusedTuning,
    PolicyLossFromHidden,
    _policy_loss_rows,
    accumulate_weight_grad,
    new_weight_grad,
)
from grpo_ds.kernels.token_math import KL_CODES, Launch


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


# How Liger's loss math is compiled, tried in order until one runs (torch.compile's keyword
# arguments; None: Liger's compiled=False)
LIGER_COMPILES = [
    ("torch.compile as Liger calls it", {}),
    ("torch.compile(dynamic=False)", {"dynamic": False}),
    (
        'torch.compile(mode="max-autotune-no-cudagraphs", dynamic=False)',
        {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
    ),
    ("uncompiled", None),
]


@contextlib.contextmanager
def _compile_with(kwargs: dict):
    """torch.compile with ``kwargs`` filled in, for the code that calls it inside (Liger compiles
    its loss math in every forward: liger_kernel/chunked_loss/fused_linear_ppo.py)."""
    original = torch.compile
    torch.compile = functools.partial(original, **kwargs)
    try:
        yield
    finally:
        torch.compile = original


class LigerLoss:
    """Liger's LigerFusedLinearGRPOLoss, compiled the first way of LIGER_COMPILES (from
    ``state["attempt"]``) that runs; a way that raises is noted in ``state["failed"]`` and the next
    one is tried, in the same call."""

    def __init__(self, state: dict, **kwargs):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        self.state, self.losses = (
            state,
            {c: LigerFusedLinearGRPOLoss(compiled=c, **kwargs) for c in (False, True)},
        )

    def __call__(self, **inputs) -> torch.Tensor:
        while True:
            name, kwargs = LIGER_COMPILES[self.state["attempt"]]
            try:
                if kwargs is None:
                    return self.losses[False](**inputs)[0]
                with _compile_with(kwargs):
                    return self.losses[True](**inputs)[0]
            except Exception as e:  # noqa: BLE001 - the next way is tried; the note keeps the reason
                if kwargs is None:
                    raise
                self.state["failed"].append(
                    f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
                )
                self.state["attempt"] += 1
                torch._dynamo.reset()


def variant_names(args: argparse.Namespace) -> list[str]:
    names = ["eager"]
    for backend in kernel_backends(args):
        names += [f"{'chunked' if backend == 'torch' else 'triton'}/{c}" for c in args.chunk_tokens]
    if liger_available():
        names.append("liger")
    return select(names, args)


def setup(args: argparse.Namespace) -> Case:
    n, h, v, seq, device, dtype = (
        args.tokens,
        args.hidden,
        args.vocab,
        args.seq_len,
        args.device,
        DTYPES[args.dtype],
    )
    b = n // seq
    hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True)  # (N, H)
    # (V, H)
    weight = torch.randn(v, h, device=device, dtype=dtype).div_(math.sqrt(h)).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=device)  # (N,)
    typical = -math.log(v) - 0.5  # log-prob of a token under softmax of standard normal logits
    old = typical + 0.1 * torch.randn(n, device=device)  # (N,)
    ref = typical + 0.1 * torch.randn(n, device=device)  # (N,)
    seq_advantages = torch.randn(b, device=device)  # (B,)
    # (N,) every token of a sequence shares its advantage
    advantages = seq_advantages.repeat_interleave(seq)
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
            variants[f"{name}/{c}"] = lambda c=c, backend=backend: (
                policy_loss_from_hidden(hidden, weight, inputs, cfg, temperature, c, backend).loss
            )
    if liger_available():
        liger = LigerLoss(
            args.liger_state,
            beta=cfg.kl_coef,
            use_ref_model=True,
            chunk_size=max(1, args.chunk_tokens[0] // seq),
            epsilon_low=cfg.clip_low,
            epsilon_high=cfg.clip_high,
            loss_type="bnpo",
            temperature=temperature,
        )
        mask = torch.ones(b, seq, device=device, dtype=torch.long)  # (B, T)
        variants["liger"] = lambda: liger(
            _input=hidden.view(b, seq, h),
            lin_weight=weight,
            selected_token_ids=targets.view(b, seq),
            attention_mask=mask,
            advantages=seq_advantages,
            ref_per_token_logps=ref.view(b, seq),
            old_per_token_logps=old.view(b, seq),
        )
    return Case(variants, leaves=(hidden, weight))


@dataclass
class SweepInputs:
    """What every --sweep measurement reads: the loss inputs of ``setup`` plus the per-token
    ones."""

    hidden: torch.Tensor  # (N, H), requires grad
    weight: torch.Tensor  # (V, H), requires grad
    targets: torch.Tensor  # (N,)
    old: torch.Tensor  # (N,)
    ref: torch.Tensor  # (N,)
    adv: torch.Tensor  # (N,)
    token_weight: torch.Tensor  # (N,)
    cfg: LossConfig
    temperature: float


def _whole_loss(
    x: SweepInputs, chunk: int, tuning: FusedTuning | None = None, with_grad: bool = True
):
    """Forward + backward; or, ``with_grad`` false, the forward of inputs that need no gradient
    (autograd flags inputs that require one even under no_grad, and the Triton forward then computes
    the gradients)."""
    hidden, weight = (x.hidden, x.weight) if with_grad else (x.hidden.detach(), x.weight.detach())

    def fn():
        x.hidden.grad = x.weight.grad = None
        loss, _ = PolicyLossFromHidden.apply(
            hidden,
            weight,
            x.targets,
            x.old,
            x.ref,
            x.adv,
            x.token_weight,
            x.cfg,
            x.temperature,
            chunk,
            NO_TRUNCATION,
            tuning or FusedTuning(),
        )
        if with_grad:
            loss.backward()

    return fn


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def _chunk_matmuls(
    x: SweepInputs,
    chunk: int,
    grad_logits: torch.Tensor,
    weight_grad_sum: str = "fp32",
    logits_only: bool = False,
):
    """The chunk loop's matmuls without the row kernel: logits, then (unless logits_only) the hidden
    gradient and the weight gradient's sum, on a fixed stand-in for the logits' gradient."""

    def fn():
        grad_weight = new_weight_grad(x.weight, weight_grad_sum)
        with torch.no_grad():
            for a, b in _spans(x.hidden.shape[0], chunk):
                x.hidden[a:b] @ x.weight.t()
                if not logits_only:
                    grad_logits[: b - a] @ x.weight
                    accumulate_weight_grad(
                        grad_weight, grad_logits[: b - a], x.hidden[a:b], weight_grad_sum
                    )

    return fn


def _weight_grad_sum(x: SweepInputs, chunk: int, grad_logits: torch.Tensor, weight_grad_sum: str):
    def fn():
        grad_weight = new_weight_grad(x.weight, weight_grad_sum)
        with torch.no_grad():
            for a, b in _spans(x.hidden.shape[0], chunk):
                accumulate_weight_grad(
                    grad_weight, grad_logits[: b - a], x.hidden[a:b], weight_grad_sum
                )

    return fn


def _row_kernel(x: SweepInputs, chunk: int, launch: Launch, count: int):
    """The fused loss's row kernel (with its gradient, in place) on one chunk of logits, ``count``
    times."""
    with torch.no_grad():
        logits = x.hidden[:chunk] @ x.weight.t()  # (c, V)
    stats = torch.empty(5, chunk, device=logits.device)
    vocab, c = logits.shape[1], x.cfg

    def fn():
        for _ in range(count):
            _policy_loss_rows[(chunk,)](
                logits,
                logits.stride(0),
                x.targets[:chunk],
                x.old[:chunk],
                x.ref[:chunk],
                x.adv[:chunk],
                x.token_weight[:chunk],
                stats,
                vocab,
                1.0 / x.temperature,
                c.clip_low,
                c.clip_high,
                0.0,
                c.kl_coef,
                c.entropy_coef,
                HAS_OLD=True,
                KL=KL_CODES[c.kl_estimator],
                DUAL_CLIP=False,
                WITH_GRAD=True,
                **launch.options(vocab),
            )

    return fn


def sweep(args: argparse.Namespace) -> None:
    """The --sweep table: see the module docstring."""
    device, n = args.device, args.tokens
    torch.manual_seed(args.seed)
    case = setup(args)
    hidden, weight = case.leaves
    x = SweepInputs(
        hidden,
        weight,
        torch.randint(0, args.vocab, (n,), device=device),
        *(
            torch.randn(n, device=device) - (0 if k == "adv" else math.log(args.vocab))
            for k in ("old", "ref", "adv")
        ),
        torch.full((n,), 1.0 / n, device=device),
        loss_config(args.entropy_coef),
        args.temperature,
    )
    rows: list[list[str]] = []

    def record(section: str, config: str, fn) -> float | None:
        try:
            ms = median_ms(fn, device, warmup=args.warmup, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001 - a configuration that cannot run is a row of the table, not the end
            rows.append(
                [section, config, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"]
            )
            ms = None
        finally:
            hidden.grad = weight.grad = None
        if ms is not None:
            rows.append([section, config, fmt(ms, 2)])
        print(" | ".join(rows[-1]), flush=True)
        return ms

    def eager_full():
        hidden.grad = weight.grad = None
        case.variants["eager"]().backward()

    eager = record("reference", "eager forward + backward", eager_full)
    # chunk tokens -> the 3 chunk matmuls' time, the chunked path's floor
    matmuls: dict[int, float | None] = {}
    for chunk in args.sweep_chunks:
        spans = len(_spans(n, chunk))
        grad_logits = torch.randn(min(chunk, n), args.vocab, device=device, dtype=hidden.dtype) / n
        where = f"where the time goes, chunk {chunk:,} ({spans} chunk{'s' if spans > 1 else ''})"
        record(where, "whole loss, forward + backward (default tuning)", _whole_loss(x, chunk))
        record(
            where,
            "forward without gradients (logits matmul + row kernel)",
            _whole_loss(x, chunk, with_grad=False),
        )
        matmuls[chunk] = record(
            where,
            "3 chunk matmuls + fp32 weight-gradient sum (no row kernel)",
            _chunk_matmuls(x, chunk, grad_logits),
        )
        record(
            where, "logits matmul alone", _chunk_matmuls(x, chunk, grad_logits, logits_only=True)
        )
        for mode in WEIGHT_GRAD_SUMS:
            record(
                where,
                f"weight-gradient sum alone: {mode}",
                _weight_grad_sum(x, chunk, grad_logits, mode),
            )
        record(
            where,
            "row kernel alone, with its gradient (every chunk)",
            _row_kernel(x, min(chunk, n), Launch(), spans),
        )
        del grad_logits
    for chunk in args.sweep_chunks:
        for mode in WEIGHT_GRAD_SUMS[1:]:
            record(
                "whole loss by weight-gradient sum",
                f"chunk {chunk:,}, {mode}",
                _whole_loss(x, chunk, FusedTuning(weight_grad_sum=mode)),
            )
    chunk = min(args.sweep_chunks[0], n)
    for block_v in args.sweep_blocks:
        for warps in args.sweep_warps:
            record(
                f"row kernel, one chunk of {chunk:,}",
                Launch(block_v, warps).name(),
                _row_kernel(x, chunk, Launch(block_v, warps), 1),
            )
    notes = [
        f"time: median of {args.repeats} after {args.warmup} warm-up runs (CUDA events on the GPU)",
        f"defaults: {Launch().name()}, weight-gradient sum fp32; in training the chunk tokens "
        "follow kernels.logprob_chunk_mib / logprob_chunk_tokens",
        f"eager forward + backward: {fmt(eager, 2)} ms; the 1.5x target needs the whole loss at <= "
        f"{fmt(eager / 1.5 if eager else None, 2)} ms",
        "the Triton forward already computes the gradients (3 matmuls a chunk; the backward only "
        "scales them): 'forward without gradients' is what a forward alone would cost",
        *[
            f"chunk {chunk:,}: the 3 chunk matmuls alone take {fmt(ms, 2)} ms, so a chunked path "
            f"that does them can be at most {eager / ms:.2f}x eager (the 1.5x target is "
            f"{'within' if eager / ms >= 1.5 else 'out of'} reach of this floor)"
            for chunk, ms in matmuls.items()
            if ms and eager
        ],
    ]
    shape = (
        f"sweep, {n:,} tokens x hidden {args.hidden:,} x "
        f"vocab {args.vocab:,}, {args.dtype}, {device}"
    )
    report(
        "bench_fused_linear",
        shape,
        device,
        markdown_table(["what", "configuration", "time ms"], rows),
        notes,
        args.record,
    )


def chunk_of(name: str) -> int | None:
    head, _, tail = name.partition("/")
    return int(tail) if head in ("chunked", "triton") and tail else None


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=16384, help="N = sequences x --seq-len")
    parser.add_argument(
        "--seq-len", type=int, default=1024, help="tokens per sequence (Liger takes (B, T, H))"
    )
    parser.add_argument("--hidden", type=int, default=4096, help="H")
    parser.add_argument("--vocab", type=int, default=151936, help="V")
    parser.add_argument(
        "--chunk-tokens", type=int_list, default=[1024], help="chunk sizes, e.g. 1024,256"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--entropy-coef", type=float, default=0.0, help="entropy bonus (Liger has none)"
    )
    parser.add_argument(
        "--liger-compiled",
        type=int,
        choices=(0, 1),
        default=None,
        help="Liger's torch.compile of the loss math (default: 1 on cuda, 0 on cpu)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="time the Triton path's knobs (see above) instead"
    )
    parser.add_argument(
        "--sweep-chunks", type=int_list, default=[1024, 2048, 4096], help="--sweep's chunk sizes"
    )
    parser.add_argument(
        "--sweep-blocks",
        type=int_list,
        default=[2048, 4096, 8192],
        help="--sweep's block_v values for the row kernel",
    )
    parser.add_argument(
        "--sweep-warps", type=int_list, default=[4, 8, 16], help="--sweep's num_warps values"
    )
    parser.set_defaults(small={"tokens": 64, "seq_len": 32, "hidden": 64, "vocab": 1000})
    args = finish_args(parser.parse_args())
    if args.liger_compiled is None:
        args.liger_compiled = int(args.device == "cuda")
    args.liger_state = {
        "attempt": 0 if args.liger_compiled else len(LIGER_COMPILES) - 1,
        "failed": [],
    }
    if args.sweep:
        # the cuda defaults: a shorter timer, to stay under a minute
        if args.warmup == 3 and args.repeats == 20:
            args.warmup, args.repeats = 1, 5
        return sweep(args)
    if args.tokens % args.seq_len:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")
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
        extra["in fp32 chunks"] = lambda m: fmt(
            held(m) / chunk_mib(m) if m.peak_mib is not None and chunk_mib(m) else None, 2
        )
        notes.append(
            f"full logits ({args.tokens:,} x {args.vocab:,} {args.dtype}): {full_logits:,.0f} MiB; "
            f"gradients of hidden and weight: {grads:,.0f} MiB; one float32 chunk of logits: "
            + ", ".join(
                f"{c:,} tokens {c * args.vocab * 4 / MIB:,.0f} MiB" for c in args.chunk_tokens
            )
        )
        for m in results:
            if chunk_mib(m) and m.peak_mib is not None:
                notes.append(
                    f"{m.variant} {m.mode}: holds {held(m):,.0f} MiB beyond the inputs and their "
                    f"gradients = {held(m) / chunk_mib(m):.2f} float32 chunks of logits; less than "
                    f"the full logits: {verdict(held(m) < full_logits)}"
                )
        for prefix in ("chunked", "triton"):
            for mode in args.modes:
                fit = chunk_fit(results, prefix, mode, chunk_mib, held)
                if fit:
                    notes.append(fit + " (beyond the gradients)")
    by_key = {(m.variant, m.mode): m for m in results}
    for m in results:
        eager, liger = by_key.get(("eager", m.mode)), by_key.get(("liger", m.mode))
        if (
            not m.variant.startswith("triton/")
            or m.mode != "full"
            or not m.ms
            or args.device != "cuda"
        ):
            continue
        if eager and eager.ms:
            s = eager.ms / m.ms
            notes.append(
                f"{m.variant} full: {s:.2f}x faster than "
                f"eager (target >= 1.5x): {verdict(s >= 1.5)}"
            )
        if liger and liger.ms:
            s = liger.ms / m.ms
            notes.append(
                f"{m.variant} full: {s:.2f}x faster than "
                f"Liger (target >= 1.2x): {verdict(s >= 1.2)}"
            )
        if liger and liger.peak_mib is not None and m.peak_mib is not None:
            notes.append(
                f"{m.variant} full: peak {m.peak_mib:,.0f} MiB vs Liger {liger.peak_mib:,.0f} MiB "
                f"(target <= Liger): {verdict(m.peak_mib <= liger.peak_mib)}"
            )
    if "liger" in names:
        ran = LIGER_COMPILES[args.liger_state["attempt"]][0]
        notes.append(
            f"liger: chunk_size {max(1, args.chunk_tokens[0] // args.seq_len)} sequences, ran {ran}"
            + (
                f" (--liger-compiled {args.liger_compiled})"
                if args.liger_compiled
                else " (--liger-compiled 0)"
            )
        )
        notes.extend(f"liger: failed first, {failure}" for failure in args.liger_state["failed"])
    elif not liger_available():
        notes.append(
            "liger: liger_kernel is not installed here (pip install liger-kernel), not measured"
        )

    shape = (
        f"{args.tokens:,} tokens ({args.tokens // args.seq_len} x {args.seq_len}) x hidden "
        f"{args.hidden:,} x vocab {args.vocab:,}, {args.dtype}, {args.device}"
    )
    report(
        "bench_fused_linear",
        shape,
        args.device,
        table(results, references=("eager", "liger"), extra=extra),
        notes,
        args.record,
    )


if __name__ == "__main__":
    main()
