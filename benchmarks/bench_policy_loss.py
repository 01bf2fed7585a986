"""Benchmark grpo_ds.kernels.masked_policy_loss (grpo_ds/kernels/policy_loss.py) on a padded (B, T)
batch.

Inputs (B, T) float32: log-probs and entropy (both differentiable), old and reference log-probs, a
0/1 mask with random response lengths; advantages (B,). The step loss is token-mean aggregation of
the per-token loss (PPO clip 0.2 / 0.28, k3 KL 0.04, entropy bonus --entropy-coef).
Variants:
    eager    grpo_ds.algo: token_losses on the (B, T) batch, then aggregation.aggregate(...,
             "token-mean")
    torch    masked_policy_loss backend "torch": per-sequence sums, times sequence_weights
    triton   masked_policy_loss backend "triton" (CUDA; on CPU only under TRITON_INTERPRET=1)

GPU, every benchmark at the GPU shapes, one command:  bash benchmarks/run_gpu.sh
"""

from __future__ import annotations

import argparse
import math

import torch
from common import (
    Case,
    base_parser,
    finish_args,
    kernel_backends,
    loss_config,
    report,
    run,
    select,
    table,
)

from grpo_ds.algo.aggregation import aggregate, sequence_weights
from grpo_ds.algo.policy_loss import token_losses
from grpo_ds.kernels import masked_policy_loss


def variant_names(args: argparse.Namespace) -> list[str]:
    return select(["eager", *kernel_backends(args)], args)


def setup(args: argparse.Namespace) -> Case:
    b, t, device = args.batch, args.seq_len, args.device
    typical = -math.log(args.vocab) - 0.5
    logprobs = (typical + 0.1 * torch.randn(b, t, device=device)).requires_grad_(True)  # (B, T)
    # (B, T)
    entropy = (math.log(args.vocab) * torch.rand(b, t, device=device)).requires_grad_(True)
    old = (logprobs + 0.1 * torch.randn(b, t, device=device)).detach()  # (B, T)
    ref = (logprobs + 0.1 * torch.randn(b, t, device=device)).detach()  # (B, T)
    advantages = torch.randn(b, device=device)  # (B,)
    lengths = torch.randint(1, t + 1, (b,), device=device)  # (B,)
    mask = (torch.arange(t, device=device)[None, :] < lengths[:, None]).to(torch.int32)  # (B, T)
    # (B,)
    weights = sequence_weights(lengths.cpu(), "token-mean", t).to(
        device=device, dtype=torch.float32
    )
    cfg = loss_config(args.entropy_coef)

    def eager() -> torch.Tensor:
        per_token, _, _ = token_losses(
            logprobs, old, advantages[:, None].expand(b, t), ref, entropy, cfg
        )
        return aggregate(per_token, mask, "token-mean", t)

    def kernel(backend: str) -> torch.Tensor:
        sums = masked_policy_loss(
            logprobs, advantages, mask, cfg, old, ref, entropy, backend=backend
        )
        return (weights * sums.loss).sum()

    variants = {
        "eager": eager,
        "torch": lambda: kernel("torch"),
        "triton": lambda: kernel("triton"),
    }
    return Case(variants, leaves=(logprobs, entropy))


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--batch", type=int, default=256, help="B sequences")
    parser.add_argument("--seq-len", type=int, default=8192, help="T, padded response length")
    parser.add_argument(
        "--vocab", type=int, default=151936, help="sets the scale of the synthetic log-probs"
    )
    parser.add_argument("--entropy-coef", type=float, default=1e-3)
    parser.set_defaults(small={"batch": 4, "seq_len": 64})
    args = finish_args(parser.parse_args())
    args.dtype = "float32"  # the per-token values are float32 in training
    results, notes = run(setup, variant_names(args), args)
    shape = f"{args.batch:,} x {args.seq_len:,} tokens, float32, {args.device}"
    report("bench_policy_loss", shape, args.device, table(results), notes, args.record)


if __name__ == "__main__":
    main()
