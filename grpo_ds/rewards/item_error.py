"""``RewardError``: a reward function's way to say "scoring this one sample failed" without failing
the batch.

A function returns it in place of a sample's score. ``score_functions()`` then treats that sample
like a failed call, but alone: it scores 0.0 and is counted in the ``reward_errors/<name>`` metric
(``reward.on_error: "zero"``), or the run stops with ``RewardFailure`` naming the sample and the
cause (``"fail"``). None means something else: "no score for this sample", which is not an error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardError:
    """One sample's scoring failed: ``kind`` is a short, stable category (warnings are logged once
    per function and kind), ``message`` one line saying what happened."""

    kind: str  # e.g. "timeout", "memory", "blocked"
    message: str
