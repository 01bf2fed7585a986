"""Per-token KL penalty against the frozen reference policy.

k3 estimator of KL(pi || pi_ref) from a token sampled from pi (Schulman 2020, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), as used by GRPO (Shao et al. 2024, arXiv:2402.03300):

    r  = log pi_ref(y) - log pi(y)
    k3 = exp(r) - r - 1            >= 0, unbiased, lower variance than k1 = -r

r is clamped to [-20, 20] before the exp so that one token whose probabilities diverge cannot produce inf
(exp(20) is about 4.9e8); beyond the clamp the value is constant and its gradient is 0.
"""

from __future__ import annotations

import torch

K3_LOG_RATIO_CLAMP = 20.0


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref); same shape and dtype as the inputs."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
                         "must have the same shape")
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # (...)
    return torch.exp(log_ratio) - log_ratio - 1
