"""Group-relative advantages (GRPO).

For one prompt with a group of G completions and scalar rewards r_1..r_G:

    A_j = (r_j - mean(r)) / (std(r) + eps)     scale_rewards=True   (GRPO, Shao et al. 2024, DeepSeekMath,
                                                                     arXiv:2402.03300, "outcome supervision")
    A_j =  r_j - mean(r)                       scale_rewards=False  (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783:
                                                                     dividing by the std biases towards groups
                                                                     that are nearly all right or all wrong)

std is the UNBIASED sample standard deviation (divisor G - 1, torch.std's default), as in the DeepSeekMath
reference and TRL's GRPOTrainer. Every token of completion j later receives the same A_j.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Return group-centred (and optionally std-scaled) advantages, float32, shape (P*G,).

    ``rewards`` is (P*G,): consecutive blocks of ``group_size`` belong to one prompt. A group whose rewards
    are all equal carries no learning signal and gets exactly 0 (also for group_size == 1, where the unbiased
    std is undefined). The arithmetic is float32 whatever the input dtype.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (P*G,), got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} elements, not a multiple of group_size={group_size}; "
                         f"every prompt needs a full group of {group_size} completions")
    grouped = rewards.detach().to(torch.float32).view(-1, group_size)  # (P, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    # Equal rewards can leave a rounding residue in `centred` (mean of 0.1, 0.1, 0.1 need not be 0.1 in
    # float32); force those groups to exactly 0 so they contribute nothing to the loss.
    flat = (grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True))  # (P, 1)
    if scale_rewards and group_size > 1:
        std = grouped.std(dim=1, keepdim=True)  # (P, 1), unbiased (divisor G - 1)
        centred = centred / (std + eps)
    return torch.where(flat, torch.zeros_like(centred), centred).view(-1)  # (P*G,)
