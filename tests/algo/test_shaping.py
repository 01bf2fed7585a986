import math

import pytest
import torch

from grpo_ds.algo.shaping import kl_reward_penalty, overlong_penalty

# Hand values; float32 arithmetic on a few numbers is exact to a few ulp, far inside assert_close's
# defaults.


def test_overlong_penalty_hand_values():
    # L_max 10, buffer 4: no penalty up to 6, then linear to -1 at 10; beyond the limit -1.
    got = overlong_penalty([0, 5, 6, 7, 8, 10, 12], max_tokens=10, buffer_tokens=4, penalty=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))


def test_overlong_penalty_scales_with_the_penalty():
    torch.testing.assert_close(overlong_penalty([9], 10, 2, 0.5), torch.tensor([-0.25]))


def test_overlong_penalty_rejects_a_buffer_beyond_the_limit():
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty([3], 4, 5, 1.0)


def test_kl_reward_penalty_hand_values():
    # k3 with r = ln 2 is 2 - ln 2 - 1 = 0.3068528, with r = -ln 2 it is 0.5 + ln 2 - 1 = 0.1931472;
    # the sum is 0.5, times kl_coef 0.1 -> -0.05. Masking the second token leaves -0.03068528.
    lp = torch.tensor([math.log(0.25), math.log(0.5)])
    ref = torch.tensor([math.log(0.5), math.log(0.25)])
    got = kl_reward_penalty([lp, lp], [ref, ref], [[1, 1], [1, 0]], "k3", 0.1)
    torch.testing.assert_close(got, torch.tensor([-0.05, -0.03068528]))


def test_kl_reward_penalty_with_k1_can_be_a_bonus():
    # k1 = log pi - log pi_ref = ln 0.25 - ln 0.5 = -ln 2 per token: a policy less likely than the
    # reference gets a positive k1-based adjustment of +kl_coef * ln 2.
    got = kl_reward_penalty(
        [torch.tensor([math.log(0.25)])], [torch.tensor([math.log(0.5)])], [[1]], "k1", 1.0
    )
    torch.testing.assert_close(got, torch.tensor([math.log(2.0)]))
