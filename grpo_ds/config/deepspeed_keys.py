"""Plain reads of a DeepSpeed config dict that every layer asks: the ZeRO stage and whether a part
is offloaded.

A leaf (no grpo_ds import, no DeepSpeed import): the model layer, the memory estimate and the dry
run read a resolved config through these, and grpo_ds.config.deepspeed / deepspeed_check use them
while resolving it.
"""

from __future__ import annotations

from typing import Any


def offloaded(zero: Any, section: str) -> bool:
    """Whether ``zero`` (a zero_optimization section) offloads ``section`` ("offload_optimizer",
    "offload_param"): a section with a device other than "none" (DeepSpeed reads a missing or null
    section, or a missing device, as off)."""
    part = zero.get(section) if isinstance(zero, dict) else None
    return isinstance(part, dict) and part.get("device", "none") not in (None, "none")


def zero_stage(cfg: dict) -> int:
    """The ZeRO stage of a DeepSpeed config (0 when it has no zero_optimization section)."""
    return (cfg.get("zero_optimization") or {}).get("stage", 0)
