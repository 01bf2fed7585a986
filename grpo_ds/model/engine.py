"""The DeepSpeed engines of the model being trained: the training engine and the frozen reference engine.

Both are built from the resolved DeepSpeed config (grpo_ds.config.deepspeed); the process group must exist first
(grpo_ds.distributed.ranks.init_distributed).
"""

from __future__ import annotations

import copy

import torch

from grpo_ds.config.deepspeed_keys import zero_stage


def create_train_engine(model: torch.nn.Module, ds_config: dict, mpu=None):
    """ZeRO-3 engine with the optimizer (and scheduler) described by the resolved config; ``mpu``: Ulysses' groups."""
    import deepspeed

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
