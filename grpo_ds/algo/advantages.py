"""Advantages from scalar rewards, one per completion; every token of completion j receives A_j.

Rewards arrive as (P*G,): consecutive blocks of G completions belong to one prompt. An advantage is
a baseline subtracted from the reward, optionally divided by a scale:

    baseline "group_mean"     b_j = mean of j's group                    (GRPO, Shao et al. 2024,
                                                                          DeepSeekMath,
                                                                          arXiv:2402.03300)
    baseline "leave_one_out"  b_j = mean of the OTHER G-1 rewards        (RLOO, Ahmadian et al.
                                                                          2024, arXiv:2402.14740)
    baseline "batch_mean"     b_j = mean of all P*G rewards              (REINFORCE++, Hu 2025,
                              arXiv:2501.03262)

    scale "group"  A_j = (r_j - b_j) / (std(group of j) + eps)           (GRPO)
    scale "batch"  A_j = (r_j - b_j) / (std over the batch of (r - b) + eps)   (REINFORCE++'s
                   whitening)
    scale "none"   A_j =  r_j - b_j                                       (Dr. GRPO, Liu et al.
                                                                          2025, arXiv:2503.20783:
                                                                          the group std biases
                                                                          towards nearly
                                                                          all-right/all-wrong
                                                                          groups)

std is the UNBIASED sample standard deviation (divisor n - 1, torch.std's default), as in the
DeepSeekMath reference and TRL. With a group baseline, a group whose rewards are all equal carries
no signal and gets exactly 0 (also for G == 1, where neither the unbiased std nor a leave-one-out
mean exists).
"""

from __future__ import annotations

import torch

from grpo_ds.algo.names import BASELINES, SCALES


def check_arguments(rewards: torch.Tensor, group_size: int, baseline: str, scale: str) -> None:
    """Raise ValueError, naming the problem, for arguments ``group_advantages`` cannot take."""
    if baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (P*G,), got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} elements, not a multiple of group_size={group_size}; "
            f"every prompt needs a full group of {group_size} completions"
        )


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    baseline: str = "group_mean",
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Return advantages (P*G,) float32 for rewards (P*G,); the arithmetic is float32 whatever the
    input dtype."""
    check_arguments(rewards, group_size, baseline, scale)
    grouped = rewards.detach().to(torch.float32).view(-1, group_size)  # (P, G)
    if baseline == "batch_mean":
        centred = grouped - grouped.mean()  # (P, G)
    elif baseline == "group_mean" or group_size == 1:
        centred = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    else:  # leave_one_out: r_j - (sum - r_j) / (G - 1) = G / (G - 1) * (r_j - mean)
        # (P, G)
        centred = (grouped - grouped.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))
    if baseline != "batch_mean":
        # Equal rewards can leave a rounding residue (the mean of 0.1, 0.1, 0.1 need not be 0.1 in
        # float32); force those groups to exactly 0 so they contribute nothing to the loss.
        flat = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # (P, 1)
        centred = torch.where(flat, torch.zeros_like(centred), centred)
    if scale == "group" and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)  # (P, G)
    elif scale == "batch" and centred.numel() > 1:
        centred = centred / (centred.std() + eps)  # (P, G)
    return centred.reshape(-1)  # (P*G,)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (scale_rewards=True) or Dr. GRPO (False) advantages: group mean baseline, group std or
    no scale."""
    return group_advantages(
        rewards, group_size, "group_mean", "group" if scale_rewards else "none", eps
    )
