"""The policy under truncated sampling: top-k and top-p, replayed on the trainer's logits.

A sampler with temperature T, top-k k and top-p p draws token y at one position from

    s = logits / T
    K = {v : s_v >= s_(k)}                        s_(k) the k-th largest score (K = every token when
                                                  k is 0 or >= V)
    q = softmax(s) over K
    P = {v in K : sum of q_u over u in K with s_u > s_v  <  p}     (P = K when p = 1)
    pi(v) = exp(s_v) / sum_{u in S} exp(s_u)  for v in S = P u {y},  0 elsewhere

transformers' TopKLogitsWarper and TopPLogitsWarper (in that order) and vLLM's sampler keep the same
sets: a token is in the top-p set when the mass strictly above it is under p, so the set is the
smallest prefix of the sorted tokens holding at least p. Ties: every token whose score equals the
last kept one is kept (``s >= threshold``); a sorting implementation may keep only some of them. The
sampled token y is always in S: the sampler drew it, so it was in its set, and where the trainer's
logits differ from the sampler's by rounding, y may fall just outside the trainer's own set
(prime-rl restores it the same way).

Why it matters (trl#6789's closed form): a sampler that records log pi(y), while the trainer scores
y under the full softmax(s), gives every token an importance ratio pi_full(y) / pi(y) = Z_S / Z = M,
the probability mass the truncation kept at that position, whatever token was drawn, so every
token's gradient is scaled by its M (0.037 on average at top_k 3 on the tiny model, 0.90 at top_p
0.8 on Qwen2.5-1.5B per trl#7269). grpo_ds computes every log-prob of the policy, the old policy and
the reference model under pi (docs/concepts/truncated-sampling.md says why); at staleness 0 the
importance weight is then exactly 1.

``support_mask`` is the reference: a full sort of each row, eager. The kernels find the same set
without sorting the vocabulary (grpo_ds.kernels.support); tests compare them with this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """What a sampler keeps of a position's distribution besides the temperature: the ``top_k`` most
    likely tokens (0 = all), then the smallest set holding ``top_p`` of their mass (1.0 = all)."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def cuts(self, vocab: int) -> bool:
        """Whether it can leave out a token of a ``vocab``-token distribution."""
        return 0 < self.top_k < vocab or self.top_p < 1.0


NO_TRUNCATION = Truncation()


def support_threshold(
    logits: torch.Tensor, temperature: float, truncation: Truncation
) -> torch.Tensor:
    """(n,) float32: the smallest kept logit of each row of ``logits`` (n, V), in the logits' own
    units (before the temperature); -inf where nothing is cut. The set is {v : not logits_v <
    threshold} plus the sampled token (a NaN logit stays in, so that it reaches the loss and the NaN
    guard, as without truncation)."""
    rows, vocab = logits.shape
    if not truncation.cuts(vocab):
        return torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    raw = logits.detach().float()  # (n, V)
    ordered = raw.sort(dim=1, descending=True).values  # (n, V)
    kept = vocab if not 0 < truncation.top_k < vocab else truncation.top_k
    threshold = ordered[:, kept - 1]  # (n,) the top-k cut
    if truncation.top_p < 1.0:
        outside = raw < threshold[:, None]  # (n, V) not in K, the top-k set (ties included)
        # (n,) over K
        lse = (raw / temperature).masked_fill(outside, float("-inf")).logsumexp(dim=1)
        in_k = ~(ordered < threshold[:, None])  # (n, V) K, descending
        # (n, V) over K, descending
        q = torch.where(in_k, torch.exp(ordered / temperature - lse[:, None]), 0.0)
        above = torch.cumsum(q, dim=1) - q  # (n, V) the mass before each token in descending order
        # (n,): the first has 0 above it
        count = ((above < truncation.top_p) & in_k).sum(dim=1).clamp(min=1)
        threshold = torch.maximum(threshold, ordered.gather(1, (count - 1)[:, None]).squeeze(1))
    return threshold


def support_mask(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, truncation: Truncation
) -> torch.Tensor:
    """(n, V) bool: S of each row of ``logits`` (n, V), the sampled ``targets`` (n,) included."""
    keep = ~(logits.detach().float() < support_threshold(logits, temperature, truncation)[:, None])
    return keep.scatter_(1, targets.long()[:, None], True)
