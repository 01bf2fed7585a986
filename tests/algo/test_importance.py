import math

import pytest
import torch

from grpo_ds.algo.importance import truncated_importance_weights


def test_hand_values_and_cap():
    # pi_old / pi_sampler = 1, 1.5, 3 (capped at 2), 0.5
    old = torch.tensor([-1.0, -1.0 + math.log(1.5), -1.0 + math.log(3.0), -1.0 - math.log(2.0)])
    sampler = torch.full((4,), -1.0)
    torch.testing.assert_close(
        truncated_importance_weights(old, sampler, 2.0), torch.tensor([1.0, 1.5, 2.0, 0.5])
    )


def test_no_gradient_flows_through_the_weight():
    old = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert not truncated_importance_weights(old, torch.tensor([-1.5, -1.5]), 2.0).requires_grad


@pytest.mark.parametrize("cap", [0.5, float("nan")])
def test_cap_below_one_raises(cap):
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(torch.zeros(1), torch.zeros(1), cap)
