"""Triton: rewards (P*G,) -> advantages (P*G,) in one kernel launch (reference:
grpo_ds.algo.advantages).

One program walks the (P, G) rewards in tiles of groups: per-group mean and unbiased std, the
leave-one-out rescaling, and, when the baseline or the scale is batch-wide, the batch mean and the
batch std of the centred values, in up to three passes over the rewards. P*G is small (thousands),
so one program is enough and saves the launches and host round trips of a chain of small PyTorch
ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_ds.kernels.token_math import block_size

_BASELINE_CODES = {"group_mean": 0, "leave_one_out": 1, "batch_mean": 2}
_SCALE_CODES = {"group": 0, "batch": 1, "none": 2}


@triton.jit
def _centred_tile(
    rewards_ptr,
    p0,
    P,
    G,
    batch_mean,
    eps,
    BASELINE: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    rows = p0 + tl.arange(0, BLOCK_P)[:, None]
    cols = tl.arange(0, BLOCK_G)[None, :]
    inside = (rows < P) & (cols < G)
    # (BLOCK_P, BLOCK_G)
    r = tl.load(rewards_ptr + rows * G + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(r, axis=1) / G  # (BLOCK_P,)
    dev = tl.where(inside, r - mean[:, None], 0.0)
    if BASELINE == 2:
        centred = tl.where(inside, r - batch_mean, 0.0)
    elif BASELINE == 1:
        # r_j - mean of the others = G / (G - 1) * (r_j - mean)
        centred = dev * (G / tl.maximum(G - 1, 1))
    else:
        centred = dev
    if BASELINE != 2:
        hi = tl.max(tl.where(inside, r, float("-inf")), axis=1)
        lo = tl.min(tl.where(inside, r, float("inf")), axis=1)
        centred = tl.where((hi == lo)[:, None], 0.0, centred)
    # unbiased group std; G == 1 has none and is left unscaled (batch_mean: r_j - mean(r) != 0)
    if SCALE == 0:
        std = tl.sqrt(tl.sum(dev * dev, axis=1) / tl.maximum(G - 1, 1))
        centred = tl.where(G > 1, centred / (std[:, None] + eps), centred)
    return rows, cols, inside, centred


@triton.jit
def _advantages(
    rewards_ptr,
    out_ptr,
    P,
    G,
    eps,
    BASELINE: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    n = P * G
    batch_mean = 0.0
    if BASELINE == 2:
        total = 0.0
        for p0 in range(0, P, BLOCK_P):
            rows = p0 + tl.arange(0, BLOCK_P)[:, None]
            cols = tl.arange(0, BLOCK_G)[None, :]
            inside = (rows < P) & (cols < G)
            total += tl.sum(
                tl.sum(
                    tl.load(rewards_ptr + rows * G + cols, mask=inside, other=0.0).to(tl.float32),
                    axis=1,
                ),
                axis=0,
            )
        batch_mean = total / n
    scale = 1.0
    if SCALE == 1:  # batch std of the centred values: two-pass (mean, then squared deviations)
        s1 = 0.0
        for p0 in range(0, P, BLOCK_P):
            _, _, _, c = _centred_tile(
                rewards_ptr, p0, P, G, batch_mean, eps, BASELINE, SCALE, BLOCK_P, BLOCK_G
            )
            s1 += tl.sum(tl.sum(c, axis=1), axis=0)
        c_mean = s1 / n
        s2 = 0.0
        for p0 in range(0, P, BLOCK_P):
            _, _, inside, c = _centred_tile(
                rewards_ptr, p0, P, G, batch_mean, eps, BASELINE, SCALE, BLOCK_P, BLOCK_G
            )
            dc = tl.where(inside, c - c_mean, 0.0)
            s2 += tl.sum(tl.sum(dc * dc, axis=1), axis=0)
        # one reward: its centred value is 0
        scale = 1.0 / (tl.sqrt(s2 / tl.maximum(n - 1, 1)) + eps)
    for p0 in range(0, P, BLOCK_P):
        rows, cols, inside, c = _centred_tile(
            rewards_ptr, p0, P, G, batch_mean, eps, BASELINE, SCALE, BLOCK_P, BLOCK_G
        )
        tl.store(out_ptr + rows * G + cols, c * scale, mask=inside)


def group_advantages(
    rewards: torch.Tensor, group_size: int, baseline: str, scale: str, eps: float
) -> torch.Tensor:
    """Advantages (P*G,) float32; arguments as grpo_ds.algo.advantages.group_advantages (validated
    there)."""
    rewards = rewards.detach().contiguous()
    out = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)  # (P*G,)
    num_groups = rewards.numel() // group_size
    if num_groups:
        block_g = block_size(group_size, cap=1 << 16)
        _advantages[(1,)](
            rewards,
            out,
            num_groups,
            group_size,
            eps,
            BASELINE=_BASELINE_CODES[baseline],
            SCALE=_SCALE_CODES[scale],
            BLOCK_P=max(1, min(64, 4096 // block_g)),
            BLOCK_G=block_g,
        )
    return out
