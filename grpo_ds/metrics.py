"""Per-step metrics: metrics.jsonl in the run folder, a console line, a progress bar (rank 0 only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = ("reward_mean", "reward_std", "response_len_mean", "loss", "kl", "entropy", "clip_frac",
                "grad_norm", "tokens_per_s", "time_step_s")


class MetricsLogger:
    def __init__(self, run_dir: Path | None, total_steps: int, every_steps: int, progress_bar: bool) -> None:
        self.path = run_dir / "metrics.jsonl" if run_dir else None
        self.every_steps = every_steps
        self.history: list[dict] = []
        self.bar = tqdm(total=total_steps, desc="grpo_ds", unit="step", dynamic_ncols=True) \
            if progress_bar and run_dir else None

    def log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        line = f"step {metrics['step']:>4} " + " ".join(
            f"{k}={_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics)
        if metrics["step"] % self.every_steps == 0 or metrics["step"] == 1:
            (self.bar.write if self.bar else print)(line)
        if self.bar:
            self.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=_fmt(metrics.get("loss", math.nan)))
            self.bar.update(1)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)
