"""The DeepSpeed engines of the model being trained: the training engine and the frozen reference engine.

Both are built from the resolved DeepSpeed config (grpo_ds.config.deepspeed); the process group must exist first
(grpo_ds.distributed.ranks.init_distributed).
"""

from __future__ import annotations

import copy
import os
import re

import torch

from grpo_ds.config.deepspeed_keys import zero_stage


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder can read it. DeepSpeed 0.19.8 parses every entry as numbers
    ("9.0", "8.6+PTX"; deepspeed/ops/op_builder/builder.py, compute_capability_args) and fails on an arch-specific
    suffix such as "9.0a", which CUDA images for Hopper set, with ``ValueError: invalid literal for int() with base
    10: '0a'`` when it builds FusedAdam at the first GPU run's engine. Such an entry loses its suffix (the op is built
    for sm_90, which runs on sm_90a)."""
    return ";".join(re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", part) for part in value.replace(" ", ";").split(";") if part)


def create_train_engine(model: torch.nn.Module, ds_config: dict, mpu=None):
    """ZeRO-3 engine with the optimizer (and scheduler) described by the resolved config; ``mpu``: Ulysses' groups."""
    import deepspeed

    if arch := os.environ.get("TORCH_CUDA_ARCH_LIST"):  # read when DeepSpeed builds its fused optimizer, just below
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(arch)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=ds_config,
                                           mpu=mpu)
    return engine


def create_reference_engine(model: torch.nn.Module, ds_config: dict, mpu=None):
    """Frozen reference policy for the KL term, no optimizer: under ZeRO-3 sharded like the policy; under stages 1
    and 2, which shard optimizer states and gradients only (and DeepSpeed refuses without an optimizer), plain."""
    import deepspeed

    cfg = {k: v for k, v in copy.deepcopy(ds_config).items() if k not in ("optimizer", "scheduler")}
    if zero_stage(cfg) != 3:
        cfg["zero_optimization"] = {"stage": 0}
    cfg["managed_gradient_accumulation"] = True
    model.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
    engine.module.eval()
    return engine
