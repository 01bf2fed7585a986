import math

import torch

from grpo_ds.algo.kl import kl_k3, kl_penalty

# float64 inputs: the only error is the rounding of exp/log (~1e-16 relative), so assert_close's
# float64 defaults (rtol 1e-7, atol 1e-7) are far looser than needed yet still catch any formula
# error.


def test_zero_when_equal():
    lp = torch.tensor([-0.1, -2.0, -7.5], dtype=torch.float64)
    assert torch.equal(kl_k3(lp, lp.clone()), torch.zeros(3, dtype=torch.float64))


def test_positive_when_different():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(100, generator=gen, dtype=torch.float64) * 5  # (100,)
    ref = lp + torch.randn(100, generator=gen, dtype=torch.float64)  # (100,), differs everywhere
    assert bool((kl_k3(lp, ref) > 0).all())


def test_hand_values():
    # r = ref - policy = ln 2: k3 = 2 - ln 2 - 1 = 0.3068528; r = -ln 2: k3 = 0.5 + ln 2 - 1 =
    # 0.1931472.
    lp = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    torch.testing.assert_close(
        kl_k3(lp, ref), torch.tensor([0.3068528, 0.1931472], dtype=torch.float64)
    )


def test_gradient_hand_value():
    # d k3 / d logprob = -(exp(r) - 1) = 1 - exp(r): for r = ln 2 that is -1, for r = -ln 2 it is
    # 0.5.
    lp = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    kl_k3(lp, ref).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-1.0, 0.5], dtype=torch.float64))


def test_clamped_log_ratio_stays_finite():
    # r = 100 would overflow float32 exp; with the clamp at 20 it is exp(20) - 21 and the gradient
    # is 0.
    lp = torch.tensor([-100.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -100.0])
    out = kl_k3(lp, ref)
    assert bool(torch.isfinite(out).all())
    # float32 exp(20) = 4.85e8 has an ulp of 32, hence the relative tolerance.
    torch.testing.assert_close(
        out, torch.tensor([math.exp(20) - 21, math.exp(-20) + 19]), rtol=1e-6, atol=0.0
    )
    out.sum().backward()
    assert torch.equal(lp.grad, torch.zeros(2))


def test_k1_and_k2_hand_values_and_gradients():
    # r = ref - policy = ln 2: k1 = -r = -0.6931472 (d/dlogprob = 1); k2 = r^2 / 2 = 0.2402265
    # (d/dlogprob = -r)
    lp = torch.tensor([math.log(0.25)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.5)], dtype=torch.float64)
    k1 = kl_penalty(lp, ref, "k1")
    (g1,) = torch.autograd.grad(k1.sum(), lp)
    k2 = kl_penalty(lp, ref, "k2")
    (g2,) = torch.autograd.grad(k2.sum(), lp)
    torch.testing.assert_close(k1.detach(), torch.tensor([-0.6931472], dtype=torch.float64))
    torch.testing.assert_close(g1, torch.tensor([1.0], dtype=torch.float64))
    torch.testing.assert_close(k2.detach(), torch.tensor([0.2402265], dtype=torch.float64))
    torch.testing.assert_close(g2, torch.tensor([-0.6931472], dtype=torch.float64))


def test_unknown_estimator_raises():
    import pytest

    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
