import pytest
import torch

from grpo_ds.algo.advantages import group_advantages, grpo_advantages

# Expected values below were worked out by hand. float32 arithmetic on a handful of numbers is exact
# to a few ulp, so the float32 defaults of assert_close (rtol 1.3e-6, atol 1e-5) are tight enough to
# catch any formula change (e.g. biased std would give 1.0 instead of 0.866).


def test_hand_example_unbiased_std():
    # Group 1: [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std =
    # 0.5773503, A = +-0.5 / 0.5773503 = +-0.8660254. Group 2: [2, 4, 2, 4]: mean 3, deviations +-1,
    # var 4/3, std = 1.1547005, A = +-0.8660254.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 2.0, 4.0])
    adv = grpo_advantages(rewards, group_size=4, eps=0.0)
    a = 0.8660254
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, -a, a, -a, a]))


def test_eps_is_added_to_std():
    # [2, 4]: mean 3, unbiased std sqrt(2) = 1.4142136; eps = 0.1: A = +-1 / 1.5142136 =
    # +-0.6604088.
    adv = grpo_advantages(torch.tensor([2.0, 4.0]), group_size=2, eps=0.1)
    torch.testing.assert_close(adv, torch.tensor([-0.6604088, 0.6604088]))


def test_default_eps_close_to_unit_std():
    # Default eps = 1e-6 shifts 0.8660254 to 0.5 / (0.5773503 + 1e-6) = 0.8660239.
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([0.8660239, -0.8660239, -0.8660239, 0.8660239]))


def test_all_equal_group_is_exactly_zero():
    # In float32 the mean of [0.9, 0.9, 0.9] is not exactly 0.9: a naive (r - mean) / (std + eps)
    # gives 6e-8 / 1e-6 = 0.0555 for every member of that group. The advantage must be exactly 0.
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 1.0, 0.7, 0.7, 0.7])
    adv = grpo_advantages(rewards, group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.equal(adv[6:], torch.zeros(3))
    assert bool((adv[3:6] != 0).all())


def test_group_size_one_gives_zero():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(3))


def test_no_scaling_is_centred_rewards():
    # Dr. GRPO: only subtract the group mean (0.5 and 3).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 2.0, 4.0])
    adv = grpo_advantages(rewards, group_size=4, scale_rewards=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0, -1.0, 1.0]))


def test_float32_output_for_low_precision_input():
    adv = grpo_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.bfloat16), group_size=4, eps=0.0
    )
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254]))


def test_bad_length_raises():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        grpo_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(4), group_size=0)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 4), group_size=4)


# Hand values for the other estimators. Two groups of G=4: [1, 0, 0, 1] and the flat [1, 1, 1, 1].
TWO_GROUPS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_leave_one_out_hand_values():
    # r_j - mean of the other three: 1 - 1/3 = 0.6667, 0 - 2/3 = -0.6667; the flat group stays
    # exactly 0.
    adv = group_advantages(TWO_GROUPS, 4, "leave_one_out", "none")
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    assert torch.equal(adv[4:], torch.zeros(4))


def test_batch_mean_and_batch_std_hand_values():
    # REINFORCE++: batch mean 6/8 = 0.75 -> centred 0.25 (x6) and -0.75 (x2); unbiased std over the
    # 8 values sqrt((6 * 0.0625 + 2 * 0.5625) / 7) = sqrt(1.5 / 7) = 0.462910; 0.25 / 0.462910 =
    # 0.540062, -0.75 / 0.462910 = -1.620185. The flat group is NOT zero: it is above the batch
    # mean.
    adv = group_advantages(TWO_GROUPS, 4, "batch_mean", "batch")
    torch.testing.assert_close(
        adv,
        torch.tensor([0.540062, -1.620185, -1.620185, 0.540062] + [0.540062] * 4),
        rtol=1e-5,
        atol=1e-6,
    )


def test_group_mean_with_batch_std_hand_values():
    # centred [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]; unbiased batch std sqrt(1 / 7) = 0.377964; 0.5 /
    # it = 1.322876
    adv = group_advantages(TWO_GROUPS, 4, "group_mean", "batch")
    torch.testing.assert_close(
        adv,
        torch.tensor([1.322876, -1.322876, -1.322876, 1.322876, 0, 0, 0, 0]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_group_size_one_gives_zero_for_group_baselines():
    for baseline in ("group_mean", "leave_one_out"):
        for scale in ("group", "batch", "none"):
            assert torch.equal(
                group_advantages(torch.tensor([3.0, -1.0, 2.0]), 1, baseline, scale), torch.zeros(3)
            )


def test_unknown_estimator_pieces_raise():
    with pytest.raises(ValueError, match="unknown baseline"):
        group_advantages(TWO_GROUPS, 4, "median", "none")
    with pytest.raises(ValueError, match="unknown scale"):
        group_advantages(TWO_GROUPS, 4, "group_mean", "max")
