"""Per-step metrics: metrics.jsonl in the run folder, a console line, a progress bar, and optionally
TensorBoard and Weights & Biases (rank 0 only); and ``read_metrics``, which reads metrics.jsonl back
the way a crash or a resume leaves it (the finished run's history, grpo_ds.plot's curves)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpo_ds.config.recipe import LoggingConfig
from grpo_ds.distributed import launcher
from grpo_ds.errors import UserError, first_line
from grpo_ds.run import writes


def check_logging_extras(cfg: LoggingConfig) -> None:
    """Fail before any model loads when a requested logger is not installed."""
    wanted = [
        ("logging.tensorboard", "tensorboard", cfg.tensorboard),
        (
            "logging.wandb_project",
            "wandb",
            cfg.wandb_project is not None and cfg.wandb_mode != "disabled",
        ),
    ]
    for key, package, on in wanted:
        if on and importlib.util.find_spec(package) is None:
            raise UserError(
                key,
                f"needs the {package} package, which is not installed",
                f'pip install -e ".[{package}]", or turn it off',
            )


def wandb_mode(requested: str) -> str:
    """ "online" without any W&B credentials (WANDB_API_KEY or a ~/.netrc entry) logs offline
    instead of failing or prompting: the run folder's wandb/ can be synced later with
    `wandb sync`."""
    if requested != "online" or os.environ.get("WANDB_API_KEY"):
        return requested
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return requested
    launcher.say(
        "warning: no Weights & Biases credentials (WANDB_API_KEY or ~/.netrc): logging offline to "
        "the run folder's wandb/ (upload later with `wandb sync`)"
    )
    return "offline"


def _start_wandb(cfg: LoggingConfig, run_dir: Path, run_name: str, config: dict | None):
    """wandb.init writing to the run folder's wandb/. A run W&B cannot start (no network on the
    node, a wrong key: wandb raises after its init_timeout, 90 s by default) is one line naming the
    offline mode."""
    import wandb

    try:
        return wandb.init(
            project=cfg.wandb_project,
            name=run_name,
            dir=str(run_dir),
            mode=wandb_mode(cfg.wandb_mode),
            config=config,
        )
    except wandb.errors.Error as err:
        raise UserError(
            "logging.wandb_project",
            f"Weights & Biases could not start the run ({first_line(err)})",
            'set logging.wandb_mode to "offline" (the run folder\'s wandb/, upload later with '
            "`wandb sync`), or check the network and WANDB_API_KEY",
        ) from None


# Shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    "reward_mean",
    "reward_std",
    "no_signal_frac",
    "response_len_mean",
    "loss",
    "kl",
    "entropy",
    "clip_frac",
    "grad_norm",
    "tokens_per_s",
    "time_step_s",
)


class MetricsLogger:
    """Writes on the rank given a run folder (rank 0); every rank keeps the history."""

    def __init__(
        self,
        run_dir: Path | None,
        total_steps: int,
        cfg: LoggingConfig,
        run_name: str = "",
        config: dict | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl" if run_dir else None
        self.every_steps = cfg.every_steps
        self.total_steps = total_steps
        self.history: list[dict] = []
        # a bar only where stderr is a terminal: in a log file (nohup, SLURM, `> log`) its
        # carriage-returned frames would be most of the bytes, and the step lines (every
        # logging.every_steps) are the progress there
        self.bar = (
            tqdm(total=total_steps, desc="grpo_ds", unit="step", dynamic_ncols=True)
            if cfg.progress_bar and run_dir and sys.stderr.isatty()
            else None
        )
        self.tensorboard = self.wandb = None
        if run_dir and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if run_dir and cfg.wandb_project is not None:
            self.wandb = _start_wandb(cfg, run_dir, run_name, config)

    def resume(self, history: list[dict]) -> None:
        """Continue after a checkpoint: the steps already done are the history, and the bar starts
        past them."""
        self.history[:] = history
        if self.bar:
            self.bar.update(len(history))

    def log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if self.path is None:
            return
        # a failed write names the file (grpo_ds.run.writes)
        writes.append_line(self.path, json.dumps(metrics))
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, metrics["step"])
        if self.wandb:
            self.wandb.log(numbers, step=metrics["step"])
        line = f"step {metrics['step']:>4} " + " ".join(
            f"{k}={_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics
        )
        # first, last
        if metrics["step"] % self.every_steps == 0 or metrics["step"] in (1, self.total_steps):
            (self.bar.write if self.bar else print)(line)
        if self.bar:
            self.bar.set_postfix(
                reward=f"{metrics['reward_mean']:.3f}", loss=_fmt(metrics.get("loss", math.nan))
            )
            self.bar.update(1)

    def samples(self, step: int, records: list[dict]) -> None:
        """Append {"step", "samples": [{"prompt", "completion", "reward"}, ...]} to samples.jsonl
        (and TensorBoard)."""
        if self.path is None:
            return
        writes.append_line(
            self.path.parent / "samples.jsonl", json.dumps({"step": step, "samples": records})
        )
        if self.tensorboard:
            text = "\n\n".join(
                f"**reward {r['reward']:.3f}** {r['prompt']!r} -> {r['completion']!r}"
                for r in records
            )
            self.tensorboard.add_text("samples", text, step)

    def close(self) -> None:
        """Close the progress bar and the sinks (idempotent: a preempted run closes early, its
        session again)."""
        if self.bar:
            self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.bar = self.tensorboard = self.wandb = None


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: allocated GPU memory on CUDA, resident memory on the
    CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl, one per step in step order (the last record of a
    repeated step)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a folder" if run_dir.exists() else "not found"
        raise UserError(
            str(run_dir),
            what,
            "give a run folder (run.output_dir/run.name) that holds metrics.jsonl",
        )
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        runs = sorted(str(p.parent) for p in run_dir.glob("*/metrics.jsonl"))
        fix = (
            f"did you mean {' or '.join(runs[:3])}?"
            if runs
            else "a run writes it from its first step on"
        )
        raise UserError(str(path), "not found", fix)
    by_step: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn line from a crash (or an interrupted write before a resume)
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            by_step.pop(step, None)  # a resumed run logs a step again: the last record wins
            by_step[step] = record
    if not by_step:
        raise UserError(
            str(path), "has no complete records", "a run logs one line per step; wait for step 1"
        )
    return [by_step[step] for step in sorted(by_step)]
