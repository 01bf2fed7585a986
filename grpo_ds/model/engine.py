"""The DeepSpeed engines of the model being trained: the training engine and the frozen reference
engine.

Both are built from the resolved DeepSpeed config (grpo_ds.config.deepspeed); the process group must
exist first (grpo_ds.distributed.ranks.init_distributed).
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import sys

import torch

from grpo_ds.config.deepspeed_keys import zero_stage


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder can read it. DeepSpeed 0.19.8 parses every
    entry as numbers ("9.0", "8.6+PTX"; deepspeed/ops/op_builder/builder.py,
    compute_capability_args) and fails on an arch-specific suffix such as "9.0a", which CUDA images
    for Hopper set, with ``ValueError: invalid literal for int() with base 10: '0a'`` when it builds
    FusedAdam at the first GPU run's engine. Such an entry loses its suffix (the op is built for
    sm_90, which runs on sm_90a)."""
    return ";".join(
        re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", part)
        for part in value.replace(" ", ";").split(";")
        if part
    )


def create_train_engine(model: torch.nn.Module, ds_config: dict, mpu=None):
    """ZeRO-3 engine with the optimizer (and scheduler) described by the resolved config; ``mpu``:
    Ulysses' groups."""
    import deepspeed

    # read when DeepSpeed builds its fused optimizer, just below
    if arch := os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(arch)

    _import_muon_uncompiled(ds_config)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
        mpu=mpu,
    )
    return engine


_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _import_muon_uncompiled(ds_config: dict) -> None:
    """DeepSpeed 0.19's ZeRO optimizers import its Muon optimizer's module on their first use
    (deepspeed/runtime/zero: utils.py's supported-optimizer check, and every gradient reduction, for
    an isinstance test), and that module's torch.compile decorators import torch._inductor: about
    1.5 s of CPU in every rank's start (measured), for an optimizer grpo_ds does not build unless
    the DeepSpeed config names it. Import it first with TorchDynamo off for that import only
    (TORCHDYNAMO_DISABLE: each decorator then leaves its function as it is, which nothing here
    calls); a config whose optimizer is Muon gets DeepSpeed's own compiled import."""
    optimizer = str((ds_config.get("optimizer") or {}).get("type", ""))
    if _MUON in sys.modules or "muon" in optimizer.lower():
        return
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(_MUON)
    except ImportError:
        pass  # a DeepSpeed without Muon: nothing to import
    finally:
        if previous is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous


def no_second_fp32_copy(
    weight_bytes: int, stage: int, dp: int, offload_optimizer: bool, master_bytes: int = 4
) -> bool:
    """Whether a run keeps no master copy of its weights besides the weights themselves: weights as
    wide as the master (float32, or bfloat16 in lean bf16 mode, train.lean_bf16), the optimizer on
    the device, and the rank's partition the whole model (ZeRO 0, which has no master copy, or ZeRO
    1-2 at one data-parallel rank, where ``share_fp32_master`` makes the master the weights). The
    memory estimate's rule."""
    return (
        weight_bytes == master_bytes
        and not offload_optimizer
        and (stage == 0 or (stage in (1, 2) and dp == 1))
    )


def shared_master_note(freed_bytes: int) -> str:
    """The one-line note a run prints when ``share_fp32_master`` freed the second copy."""
    saved = (
        f"{freed_bytes / 2**30:.2f} GiB"
        if freed_bytes >= 2**30
        else f"{freed_bytes / 2**20:.1f} MiB"
    )
    return (
        "ZeRO stage 1's master weights are the module's own weights on one rank (no second copy: "
        f"{saved} saved)"
    )


def share_fp32_master(engine) -> int:
    """Let ZeRO stage 1-2's fp32 master weights be the module's own float32 weights, at one rank;
    returns the bytes this frees (0 where nothing changed).

    DeepSpeed's stage 1-2 optimizer flattens the trained weights into one buffer per parameter group
    and keeps the rank's partition of it as a separate fp32 "master" tensor, a clone, that the torch
    optimizer updates; after each step it copies the master back into the flat weights. With float32
    weights and one rank the clone equals the whole flat buffer, byte for byte: a second copy of
    every trained weight that nothing needs. This points each master at the flat buffer itself
    (``.data``: the optimizer's parameter, its state and its param group stay the same objects), so
    the optimizer updates the module's weights in place and the copy back is a copy onto itself.
    Lean bf16 mode (DeepSpeed's bf16 master weights) is shared the same way: its master is a bf16
    clone. Checkpoints keep DeepSpeed's format (the master partition is saved and loaded in place,
    so loading writes the weights too). Where the master must differ (bf16/fp16 weights, an
    offloaded optimizer on the host, more than one rank holding a partition) nothing changes. Call
    again after loading a checkpoint: a loader that replaced the master tensor instead of writing
    into it is linked again, after copying its values into the weights.
    """
    optimizer = engine.optimizer
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)
    flats = getattr(optimizer, "parallel_partitioned_bit16_groups", None)
    if masters is None or flats is None or engine.zero_optimization_stage() not in (1, 2):
        return 0
    freed = 0
    for master, partitions in zip(masters, flats, strict=True):
        if len(partitions) != 1:  # partitioned over data-parallel ranks
            continue
        flat = partitions[0]
        if (master.dtype, master.shape, master.device) != (
            flat.dtype,
            flat.shape,
            flat.device,
        ) or master.data_ptr() == flat.data_ptr():
            continue
        with torch.no_grad():
            flat.copy_(master)
        freed += master.numel() * master.element_size()
        master.data = flat.data
    if freed and hasattr(optimizer, "_link_all_hp_params"):
        # DeepSpeed maps every parameter to its fragment of the master (a view, made when the
        # optimizer was built), which universal checkpoints load into and which kept the old copy
        # alive: map them to the shared storage.
        optimizer._link_all_hp_params()
    return freed


def create_reference_engine(model: torch.nn.Module, ds_config: dict, mpu=None):
    """Frozen reference policy for the KL term, no optimizer: under ZeRO-3 sharded like the policy;
    under stages 1 and 2, which shard optimizer states and gradients only (and DeepSpeed refuses
    without an optimizer), plain."""
    import deepspeed

    cfg = {k: v for k, v in copy.deepcopy(ds_config).items() if k not in ("optimizer", "scheduler")}
    if zero_stage(cfg) != 3:
        cfg["zero_optimization"] = {"stage": 0}
    cfg["managed_gradient_accumulation"] = True
    model.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
    engine.module.eval()
    return engine
