"""The names a recipe chooses among, one tuple per formula family: the formulas are in the modules
beside this one.

This module imports nothing (no torch), so that the recipe schema (grpo_ds.config, which imports no
torch) can declare these names as the choices of its keys, and the formulas can check their
arguments against the same tuples.
"""

from __future__ import annotations

# grpo_ds.algo.advantages: how the baseline is taken and how the centred rewards are scaled.
BASELINES: tuple[str, ...] = ("group_mean", "leave_one_out", "batch_mean")
SCALES: tuple[str, ...] = ("group", "batch", "none")
# The named estimators of algorithm.advantage: (baseline, default scale).
ESTIMATORS: dict[str, tuple[str, str]] = {
    "grpo": ("group_mean", "group"),  # DeepSeekMath
    "dr_grpo": ("group_mean", "none"),  # Dr. GRPO: never scaled
    "rloo": ("leave_one_out", "none"),  # RLOO
    "reinforce_pp": ("batch_mean", "batch"),  # REINFORCE++: batch mean baseline, batch whitening
}
# grpo_ds.algo.kl: the estimators of KL(pi || pi_ref) per token.
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
# grpo_ds.algo.policy_loss: ppo_clip_loss, gspo_loss.
POLICY_LOSSES: tuple[str, ...] = ("ppo_clip", "gspo")
# grpo_ds.algo.aggregation: how token losses are summed into the step loss.
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
