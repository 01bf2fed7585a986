"""The training curves of a run's metrics.jsonl, for ``python -m grpo_ds.plot``: the panels its
keys give (``panels``), smoothing (``moving_average``), and each panel drawn on a matplotlib axes
(``draw_panel``; the axes is given: this module never imports matplotlib).

One panel per curve: reward (mean with a +-std band, plus ``reward/NAME`` per function), response
length, KL, entropy, clip fraction, grad norm, loss, per-phase timings (stacked; their sum is
``time_step_s``) and tokens/s. Panels whose keys the file lacks are skipped.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from grpo_ds.errors import UserError


@dataclass(frozen=True)
class Panel:
    """One axes: a line per key in ``lines``; ``band`` is a std key drawn as lines[0] +- std;
    ``stack`` keys are stacked areas under the lines."""

    title: str
    lines: tuple[str, ...]
    band: str | None = None
    stack: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return self.lines + self.stack + ((self.band,) if self.band else ())


def numeric_keys(records: Iterable[dict]) -> list[str]:
    """Keys holding a number (not a bool) in at least one record, ``step`` aside, sorted."""
    found = {k for r in records for k, v in r.items() if _is_number(v)}
    found.discard("step")
    return sorted(found)


def panels(available: Iterable[str], keys: Sequence[str] | None = None) -> list[Panel]:
    """The panels to draw, in order, for the metric keys ``available``.

    ``keys`` (None: every known curve) narrows the panels to those keys; a selected key that no
    standard panel shows (``lr``, ``stop_frac``, ...) gets a panel of its own. A selected key
    missing from ``available`` is a UserError that lists the available ones.
    """
    available = set(available)
    if keys is not None:
        _check_selection(keys, available)
    wanted = available if keys is None else set(keys)
    standard = [
        Panel(
            "reward",
            ("reward_mean", *sorted(k for k in available if k.startswith("reward/"))),
            band="reward_std",
        ),
        Panel("groups with equal rewards (no signal)", ("no_signal_frac",)),
        Panel("response length (tokens)", ("response_len_mean",)),
        Panel("KL", ("kl",)),
        Panel("entropy", ("entropy",)),
        Panel("clip fraction", ("clip_frac",)),
        Panel("grad norm", ("grad_norm",)),
        Panel("loss", ("loss",)),
        Panel(
            "time per step (s)",
            ("time_step_s",),
            stack=tuple(
                sorted(
                    (
                        k
                        for k in available
                        if k.startswith("time_") and k.endswith("_s") and k != "time_step_s"
                    ),
                    key=_phase_order,
                )
            ),
        ),
        Panel("tokens / s", ("tokens_per_s", "generated_tokens_per_s")),
    ]
    chosen, shown = [], set()
    for p in standard:
        lines = tuple(k for k in p.lines if k in available and k in wanted)
        stack = tuple(k for k in p.stack if k in available and k in wanted)
        band = p.band if p.band in available and lines[:1] == p.lines[:1] else None
        if lines or stack:
            chosen.append(Panel(p.title, lines, band, stack))
            shown.update(chosen[-1].keys)
    chosen += [Panel(k, (k,)) for k in dict.fromkeys(keys or ()) if k not in shown]
    if not chosen:
        raise UserError(
            "metrics.jsonl",
            "holds none of the standard curves",
            f"choose some with --keys (available: {', '.join(sorted(available)) or 'none'})",
        )
    return chosen


def moving_average(values: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over the last ``n`` points (fewer at the start); NaN and inf points are left
    out."""
    values = np.asarray(values, dtype=float)
    if n <= 1 or values.size == 0:
        return values
    ok = np.isfinite(values)
    sums = np.concatenate(([0.0], np.cumsum(np.where(ok, values, 0.0))))
    counts = np.concatenate(([0], np.cumsum(ok)))
    end = np.arange(1, values.size + 1)
    start = np.maximum(end - n, 0)
    count = counts[end] - counts[start]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (sums[end] - sums[start]) / count, np.nan)


def draw_panel(ax, panel: Panel, records: list[dict], smooth: int) -> None:
    if panel.stack:
        x = np.array([r["step"] for r in records])
        ys = [
            np.nan_to_num(moving_average(_column(records, k), smooth), nan=0.0) for k in panel.stack
        ]
        ax.stackplot(x, ys, labels=[_label(k) for k in panel.stack], alpha=0.7)
    for i, key in enumerate(panel.lines):
        x, y = _series(records, key)
        color = "black" if panel.stack else f"C{i}"
        label = "step (total)" if panel.stack else _label(key)
        if smooth > 1:
            ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(
            x, moving_average(y, smooth), color=color, linewidth=1.5 if i == 0 else 1.0, label=label
        )
        if i == 0 and panel.band:
            xb, mean, std = _aligned(records, key, panel.band)
            mean, std = moving_average(mean, smooth), moving_average(std, smooth)
            ax.fill_between(
                xb, mean - std, mean + std, color=color, alpha=0.2, linewidth=0, label="± std"
            )
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(panel.lines) + len(panel.stack) + bool(panel.band) > 1:
        ax.legend(fontsize="small")


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) over the records that hold a number at ``key``."""
    pairs = [(r["step"], float(r[key])) for r in records if _is_number(r.get(key))]
    x, y = zip(*pairs, strict=True) if pairs else ((), ())
    return np.array(x, dtype=float), np.array(y, dtype=float)


def _aligned(records: list[dict], a: str, b: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    both = [r for r in records if _is_number(r.get(a)) and _is_number(r.get(b))]
    return (
        np.array([r["step"] for r in both], dtype=float),
        np.array([float(r[a]) for r in both]),
        np.array([float(r[b]) for r in both]),
    )


def _column(records: list[dict], key: str) -> np.ndarray:
    """Values at ``key`` for every record, NaN where missing (for stacked areas, which need a common
    x)."""
    return np.array([float(r[key]) if _is_number(r.get(key)) else np.nan for r in records])


def _phase_order(key: str) -> tuple[int, str]:
    """The loop's order for the phases it times; any other time_*_s key after them, by name."""
    phases = ("time_rollout_s", "time_reward_s", "time_logprob_s", "time_update_s", "time_sync_s")
    return (phases.index(key) if key in phases else len(phases), key)


def _label(key: str) -> str:
    if key.startswith("time_") and key.endswith("_s"):
        return key[len("time_") : -len("_s")]
    return key


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_selection(keys: Sequence[str], available: set[str]) -> None:
    if not keys:
        raise UserError(
            "--keys",
            "is empty",
            "name at least one metric key, or leave --keys out for every curve",
        )
    for key in keys:
        if key not in available:
            close = difflib.get_close_matches(key, sorted(available), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(
                "--keys", f"unknown key {key!r}", f"{hint}available: {', '.join(sorted(available))}"
            )
