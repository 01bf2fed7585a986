"""grpo_ds.kernels.group_advantages (Triton: grpo_ds/kernels/advantages.py) against the reference
grpo_ds.algo.advantages.group_advantages, for every baseline x scale."""

import itertools

import pytest
import torch

from grpo_ds import kernels
from grpo_ds.algo.advantages import group_advantages as reference_advantages
from grpo_ds.algo.names import BASELINES, SCALES
from tests.kernels.tolerances import compare

F32, BF16 = torch.float32, torch.bfloat16


def rewards_for(
    num_groups: int, group_size: int, seed: int = 0, device: str = "cpu"
) -> torch.Tensor:
    """(P*G,) rewards: group 0 all 0.1 (its float32 mean is not exactly 0.1), group 1 binary (half
    right), the rest uniform in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(num_groups, group_size, generator=gen)  # (P, G)
    rewards[0] = 0.1
    if num_groups > 1:
        rewards[1] = (torch.arange(group_size) % 2).float()
    return rewards.reshape(-1).to(device)


def compare_advantages(
    backend: str,
    dtype: torch.dtype,
    num_groups: int,
    group_size: int,
    device: str = "cpu",
    seed: int = 0,
) -> None:
    """Every baseline x scale against the reference; groups of equal rewards get exactly 0 with a
    group baseline (with G = 1 that is every group)."""
    rewards = rewards_for(num_groups, group_size, seed, device)
    for baseline, scale in itertools.product(BASELINES, SCALES):

        def kernel(rewards, baseline=baseline, scale=scale):
            return {
                "advantages": kernels.group_advantages(
                    rewards, group_size, baseline, scale, backend=backend
                )
            }

        def reference(rewards, baseline=baseline, scale=scale):
            return {"advantages": reference_advantages(rewards, group_size, baseline, scale)}

        got = compare(
            kernel,
            reference,
            {"rewards": rewards},
            dtype,
            low_precision=("rewards",),
            what=f"{backend} {baseline}/{scale} G={group_size}",
        )["advantages"]
        assert got.dtype == F32 and got.shape == rewards.shape
        if baseline != "batch_mean":
            flat = got[:group_size] if group_size > 1 else got
            assert torch.equal(flat, torch.zeros_like(flat)), (
                f"{baseline}/{scale}: equal rewards must give 0"
            )


# G = 1 (no group statistics exist), G = 4, and G = 5 (not a power of two: masked lanes in the group
# tile). 70 groups of 5: more than one tile of 64 groups.
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_groups", "group_size"), [(6, 1), (3, 4), (70, 5)])
def test_every_baseline_and_scale(backend, dtype, num_groups, group_size):
    compare_advantages(backend, dtype, num_groups, group_size)


def test_single_reward(backend):
    # One prompt, one completion: nothing to compare it with, so 0 for every baseline and scale.
    for baseline, scale in itertools.product(BASELINES, SCALES):
        got = kernels.group_advantages(torch.tensor([0.7]), 1, baseline, scale, backend=backend)
        assert torch.equal(got, torch.zeros(1)), (baseline, scale)


def test_bad_arguments_raise(backend):
    with pytest.raises(ValueError, match="multiple of group_size"):
        kernels.group_advantages(torch.zeros(5), 2, backend=backend)
    with pytest.raises(ValueError, match="unknown baseline"):
        kernels.group_advantages(torch.zeros(4), 2, "median", backend=backend)
