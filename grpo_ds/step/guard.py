"""The NaN guard across a run's optimizer steps.

A non-finite loss on any rank skips that optimizer step on every rank
(grpo_ds.step.update.optimizer_step); a non-finite gradient norm after a step counts the same.
``train.max_nonfinite_steps`` such optimizer steps in a row stop the run with one line naming the
last good checkpoint. A step with any of them writes no checkpoint (grpo_ds.step.save): its weights
may not be good.
"""

from __future__ import annotations

import math
from pathlib import Path

from grpo_ds.errors import UserError
from grpo_ds.run import checkpoint


class NonfiniteGuard:
    """Counts one step's non-finite optimizer steps (``nonfinite``) and its finite gradient norms
    (``grad_norms``), and the non-finite ones in a row across steps."""

    def __init__(self, limit: int, run_dir: Path) -> None:
        self.limit, self.run_dir = limit, run_dir
        self.in_a_row = 0
        self.grad_norms: list[float] = []
        self.nonfinite = 0

    def start_step(self) -> None:
        self.grad_norms, self.nonfinite = [], 0

    def after_optimizer_step(self, step: int, stepped: bool, engine) -> None:
        """After one optimizer step of step ``step`` (``stepped`` False: skipped for a non-finite
        loss). Engines that report no norm (ZeRO stages 0-2 on some paths) give None: nothing to
        check."""
        grad_norm = engine.get_global_grad_norm() if stepped else math.nan
        if grad_norm is None or math.isfinite(grad_norm):
            if grad_norm is not None:
                self.grad_norms.append(float(grad_norm))
            self.in_a_row = 0
        else:
            self.nonfinite, self.in_a_row = self.nonfinite + 1, self.in_a_row + 1
        if self.in_a_row >= self.limit:
            good = checkpoint.complete_checkpoints(self.run_dir)
            raise UserError(
                f"step {step}",
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or "
                "gradient norm (their updates were skipped)",
                f"the last good checkpoint is "
                f"{good[0] if good else 'none'}; lower train.lr, check the rewards and the data, "
                "or raise train.max_nonfinite_steps",
            )
