import dataclasses
import math

import pytest
import torch

from grpo_ds.algo.policy_loss import LossConfig, gspo_loss, ppo_clip_loss, token_losses
from grpo_ds.config.recipe import AlgorithmConfig
from tests.algo.loss_configs import loss_config

# All tensors are float64 and the ratio is rebuilt from exp(log(ratio) + c - c), exact to ~1e-16
# relative, so assert_close's float64 defaults (rtol 1e-7, atol 1e-7) are ample yet far below any
# hand-value difference.

F64 = torch.float64


def _run(ratios, advantages, clip_low, clip_high):
    old = torch.full((len(ratios),), -1.3, dtype=F64)  # (n,) arbitrary old log-probs
    # (n,)
    logprobs = (old + torch.tensor([math.log(r) for r in ratios], dtype=F64)).requires_grad_(True)
    adv = torch.tensor(advantages, dtype=F64)  # (n,)
    loss, clipped = ppo_clip_loss(logprobs, old, adv, clip_low, clip_high)
    loss.sum().backward()
    return loss.detach(), clipped, logprobs.grad


def test_hand_values_clip_indicator_and_gradient():
    # clip range [0.8, 1.28]. Per token: ratio, A -> loss, clipped, d loss / d logprob (= -A * ratio
    # if unclipped)
    #   1.1,  2 -> max(-2.2, -2.2)   = -2.2,  0, -2.2    (inside the range)
    #   1.5,  1 -> max(-1.5, -1.28)  = -1.28, 1,  0      (above 1 + clip_high, A > 0)
    #   0.5, -1 -> max( 0.5,  0.8)   =  0.8,  1,  0      (below 1 - clip_low, A < 0)
    #   1.5, -1 -> max( 1.5,  1.28)  =  1.5,  0,  1.5    (above the range but A < 0: not clipped)
    #   0.5,  1 -> max(-0.5, -0.8)   = -0.5,  0, -0.5    (below the range but A > 0: not clipped)
    #   1.5,  0 -> 0,                         0,  0
    loss, clipped, grad = _run(
        [1.1, 1.5, 0.5, 1.5, 0.5, 1.5], [2.0, 1.0, -1.0, -1.0, 1.0, 0.0], 0.2, 0.28
    )
    torch.testing.assert_close(loss, torch.tensor([-2.2, -1.28, 0.8, 1.5, -0.5, 0.0], dtype=F64))
    assert torch.equal(clipped, torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([-2.2, 0.0, 0.0, 1.5, -0.5, 0.0], dtype=F64))


@pytest.mark.parametrize(
    ("clip_low", "clip_high", "expected_loss", "expected_clipped", "expected_grad"),
    [
        # ratio 1.25 with A = 1 and ratio 0.75 with A = -1.
        (0.2, 0.2, [-1.2, 0.8], [1.0, 1.0], [0.0, 0.0]),  # symmetric: both outside [0.8, 1.2]
        # clip-higher: 1.25 < 1.28 no longer clipped
        (0.2, 0.28, [-1.25, 0.8], [0.0, 1.0], [-1.25, 0.0]),
        # wider low side: 0.75 > 0.7 no longer clipped
        (0.3, 0.2, [-1.2, 0.75], [1.0, 0.0], [0.0, 0.75]),
    ],
)
def test_asymmetric_clip(clip_low, clip_high, expected_loss, expected_clipped, expected_grad):
    loss, clipped, grad = _run([1.25, 0.75], [1.0, -1.0], clip_low, clip_high)
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=F64))
    assert torch.equal(clipped, torch.tensor(expected_clipped, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=F64))


def test_gradient_only_through_logprobs():
    old = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=F64, requires_grad=True)
    logprobs = torch.tensor([-0.9, -2.2], dtype=F64, requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, old, adv, 0.2, 0.2)
    loss.sum().backward()
    assert old.grad is None and adv.grad is None
    assert logprobs.grad is not None


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="same shape"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(1), 0.2, 0.2)


def test_dual_clip_hand_values():
    # clip range [0.8, 1.2], dual_clip 3. Per token: ratio, A -> loss, clipped, gradient
    #   5, -1 -> PPO max(5, 1.2) = 5, dual min(5, 3) = 3, 1, 0     (the dual clip bounds it)
    #   2, -1 -> PPO 2 < 3                            = 2, 0, 2     (-A * ratio)
    #   5,  1 -> PPO max(-5, -1.2) = -1.2 (A > 0: no dual clip), 1, 0
    #   0.5, -1 -> PPO max(0.5, 0.8) = 0.8 < 3        = 0.8, 1, 0
    old = torch.full((4,), -1.3, dtype=F64)
    logprobs = (
        old + torch.tensor([math.log(r) for r in (5.0, 2.0, 5.0, 0.5)], dtype=F64)
    ).requires_grad_(True)
    loss, clipped = ppo_clip_loss(
        logprobs, old, torch.tensor([-1.0, -1.0, 1.0, -1.0], dtype=F64), 0.2, 0.2, dual_clip=3.0
    )
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), torch.tensor([3.0, 2.0, -1.2, 0.8], dtype=F64))
    assert torch.equal(clipped, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64))
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=F64))


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.2, 0.2, dual_clip=1.0)


def _gspo(diffs, mask, seq, adv, clip_low, clip_high):
    old = torch.full((len(diffs),), -2.0, dtype=F64)
    logprobs = (old + torch.tensor(diffs, dtype=F64)).requires_grad_(True)
    loss, clipped = gspo_loss(
        logprobs,
        old,
        torch.tensor(adv, dtype=F64),
        torch.tensor(seq),
        torch.tensor(mask, dtype=F64),
        clip_low,
        clip_high,
    )
    loss.sum().backward()
    return loss.detach(), clipped, logprobs.grad


def test_gspo_hand_values():
    # Sequence 0: log-ratios 0.1, 0.3 -> mean 0.2 -> s = e^0.2 = 1.2214028 > 1.2: clipped as a whole
    # (A = 1):
    #   loss -1.2 on both tokens, gradient 0.
    # Sequence 1: log-ratios -0.1, [5.0 masked out: an observation token], 0.1 -> mean 0 -> s = 1;
    # A = -2:
    #   loss 2 on every token, gradient -A * s = 2 on every token (the masked one too: the driver
    #       zeroes its
    #   weight; the formula itself is per token).
    loss, clipped, grad = _gspo(
        [0.1, 0.3, -0.1, 5.0, 0.1],
        [1, 1, 1, 0, 1],
        [0, 0, 1, 1, 1],
        [1.0, 1.0, -2.0, -2.0, -2.0],
        0.2,
        0.2,
    )
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.2, 2.0, 2.0, 2.0], dtype=F64))
    assert torch.equal(clipped, torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 2.0, 2.0, 2.0], dtype=F64))


def test_gspo_unclipped_gradient_is_the_sequence_ratio():
    # clip_high 0.3: s = 1.2214028 is inside [0.8, 1.3]; loss -s and gradient -A * s = -1.2214028
    # per token.
    loss, clipped, grad = _gspo([0.1, 0.3], [1, 1], [0, 0], [1.0, 1.0], 0.2, 0.3)
    s = math.exp(0.2)
    torch.testing.assert_close(loss, torch.tensor([-s, -s], dtype=F64))
    assert torch.equal(clipped, torch.zeros(2, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([-s, -s], dtype=F64))


def test_the_loss_config_is_the_recipes_algorithm_section():
    """LossConfig keeps no default of its own and takes keywords only: the recipe's schema holds
    the defaults, and ``from_recipe`` reads every field from it; with kl_in_reward the KL is in the
    reward, not the loss."""
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(LossConfig))
    with pytest.raises(TypeError):
        LossConfig(0.2, 0.2, None, 0.0, "k3", 0.0, "ppo_clip")
    keys = dict(
        clip_low=0.1,
        clip_high=0.28,
        dual_clip=3.0,
        kl_coef=0.05,
        kl_estimator="k2",
        entropy_coef=0.01,
        policy_loss="gspo",
    )
    assert LossConfig.from_recipe(AlgorithmConfig(**keys)) == LossConfig(**keys)
    assert LossConfig.from_recipe(AlgorithmConfig(**keys, kl_in_reward=True)).kl_coef == 0.0
    default = AlgorithmConfig()
    assert loss_config() == LossConfig.from_recipe(default)
    assert (loss_config().clip_low, loss_config().kl_estimator) == (
        default.clip_low,
        default.kl_estimator,
    )


def test_token_losses_needs_the_sequences_for_gspo():
    with pytest.raises(ValueError, match="sequences"):
        token_losses(
            torch.zeros(2), None, torch.zeros(2), None, None, loss_config(policy_loss="gspo")
        )


def test_extreme_ratios_stay_finite_and_clip():
    # log-ratios of +-30 (ratio 1e13 and 1e-13). A = 1: the huge ratio is clipped to 1.2 -> loss
    # -1.2, grad 0; the tiny ratio is below 0.8 with A > 0: unclipped, loss -ratio ~ -9.4e-14, grad
    # -ratio. A = -1 with the huge ratio: PPO keeps -A * ratio = 1.07e13 (a pessimistic bound), the
    # dual clip (3) caps it at 3 with grad 0.
    old = torch.zeros(3, dtype=F64)
    logprobs = torch.tensor([30.0, -30.0, 30.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64)
    loss, clipped = ppo_clip_loss(logprobs, old, adv, 0.2, 0.2)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss[:2].detach(), torch.tensor([-1.2, -math.exp(-30.0)], dtype=F64))
    torch.testing.assert_close(loss[2].detach(), torch.tensor(math.exp(30.0), dtype=F64))
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    dual, dual_clipped = ppo_clip_loss(logprobs, old, adv, 0.2, 0.2, dual_clip=3.0)
    dual.sum().backward()
    torch.testing.assert_close(
        dual.detach(), torch.tensor([-1.2, -math.exp(-30.0), 3.0], dtype=F64)
    )
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -math.exp(-30.0), 0.0], dtype=F64))
    assert dual_clipped.tolist() == [1.0, 0.0, 1.0]


def test_all_masked_gspo_sequence_has_ratio_one():
    # A sequence whose tokens are all masked out has no log-ratio mean; its ratio is exp(0) = 1
    # (count clamped to 1).
    loss, _, _ = _gspo([4.0, -4.0], [0, 0], [0, 0], [1.0, 1.0], 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.0], dtype=F64))
