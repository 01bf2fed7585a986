"""Per-token KL penalty against the frozen reference policy.

Estimators of KL(pi || pi_ref) from a token sampled from pi (Schulman 2020, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), with r = log pi_ref(y) - log pi(y):

    k1 = -r                    unbiased, high variance, can be negative
    k2 = r^2 / 2               biased, low variance, >= 0
    k3 = exp(r) - r - 1        unbiased, low variance, >= 0; used by GRPO (Shao et al. 2024,
                               arXiv:2402.03300)

For k3, r is clamped to [-20, 20] before the exp so that one token whose probabilities diverge
cannot produce inf (exp(20) is about 4.9e8); beyond the clamp the value is constant and its gradient
is 0.
"""

from __future__ import annotations

import torch

from grpo_ds.algo.names import KL_ESTIMATORS

K3_LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have the same shape"
        )
    return ref_logprobs - logprobs  # (...)


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 = log pi - log pi_ref; same shape and dtype as the inputs."""
    return -_log_ratio(logprobs, ref_logprobs)


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 = (log pi_ref - log pi)^2 / 2; same shape and dtype as the inputs."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref); same shape and dtype as the inputs."""
    # (...)
    log_ratio = _log_ratio(logprobs, ref_logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate by name ("k1", "k2" or "k3")."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}"
        )
    return {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}[estimator](logprobs, ref_logprobs)
