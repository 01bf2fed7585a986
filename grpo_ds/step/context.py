"""What every phase of a step reads: one object instead of six or seven arguments each.

The session (grpo_ds/session.py) builds a ``StepContext`` once per rank, after the run's parts are
open; the phases (collect, the schedule, the advantage, the update, the report, evaluation) take it
and read what they need. It holds no step's data: that travels in the step's ``StepBatch``
(grpo_ds.step.batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import Dist
from grpo_ds.reward_models.scorer import RewardModels
from grpo_ds.rollout.base import RolloutEngine
from grpo_ds.run.metrics import MetricsLogger
from grpo_ds.run.preflight import Inputs
from grpo_ds.step.update import UpdateSettings


@dataclass
class StepContext:
    """The recipe's resolved settings, the rank layout, the engines and the logger of one rank."""

    # everything checked before load: recipe, tokenizer, prompts, reward functions, placement
    inputs: Inputs
    dist: Dist  # this rank's place in the layout
    # this rank's rollout engine (None: a trainer rank of a split placement)
    rollout: RolloutEngine | None = None
    reward_models: RewardModels | None = None  # the learned reward models this rank holds, or None
    settings: UpdateSettings | None = None  # the update phases' settings (None on a rollout rank)
    logger: MetricsLogger | None = None  # rank 0 writes metrics.jsonl; None on a rollout rank
    run_dir: Path | None = None  # the run folder

    @property
    def recipe(self) -> Recipe:
        return self.inputs.recipe

    @property
    def group_size(self) -> int:
        return self.inputs.recipe.rollout.group_size

    @property
    def bucket_bytes(self) -> int:
        """The weight sync's bucket size in bytes (rollout.weight_sync_bucket_mb)."""
        return int(self.inputs.recipe.rollout.weight_sync_bucket_mb * 2**20)
