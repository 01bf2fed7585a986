"""The job's ranks: the process group (DeepSpeed's), this process's place in it, and the collectives
the driver uses.

One rank or many, CPU (gloo) or GPU (nccl). A single `python -m grpo_ds.train` process is world size
1 with the same code path: the variables the `deepspeed` launcher would set are filled in
(grpo_ds.distributed.launcher reads them).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_ds.distributed import launcher


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. world = dp x tp x sp (one of tp, sp is 1): the ranks of a
    tensor- or sequence-parallel group are consecutive (DeepSpeed's groups), hold the same samples
    and run the same micro-batches (a sequence-parallel rank its slice of every sequence); samples
    are sharded over the data-parallel ranks."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp_size: int = 1
    sp_size: int = 1
    # "trainer" / "rollout" under split placement: this world is that side's ranks only
    role: str = "colocated"
    # split placement: the rank the launcher gave (``rank`` counts within the side)
    launch_rank: int | None = None
    # split placement: the TCP store the bridge is built on (grpo_ds.distributed.bridge)
    store: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ranks_per_shard(self) -> int:
        """Ranks that hold the same shard of the samples: a tensor- or sequence-parallel group (not
        the recipe's rollout.group_size, the completions per prompt)."""
        return self.tp_size * self.sp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ranks_per_shard

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ranks_per_shard

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    def dp_parts(self, parts: list) -> list:
        """One entry per data-parallel rank of a list with one entry per rank (each group's first
        rank's)."""
        return parts[:: self.ranks_per_shard]

    def dp_slice(self, count: int) -> tuple[int, int]:
        """This rank's contiguous, near-equal slice [lo, hi) of ``count`` items, by its
        data-parallel rank (the ranks of a tensor- or sequence-parallel group get the same
        slice)."""
        base, extra = divmod(count, self.dp_size)
        lo = self.dp_rank * base + min(self.dp_rank, extra)
        return lo, lo + base + (self.dp_rank < extra)

    # Collectives for the driver's small objects; no-ops at world size 1. Kernels never communicate.
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def decide(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run on rank 0 only, its result on every rank. If it raises, every rank
        raises the same exception (no rank is left waiting in a collective)."""
        message = None
        if self.is_main:
            try:
                message = ("ok", fn(*args))
            except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                message = ("failed", err)
        status, payload = self.broadcast(message)
        if status == "failed":
            raise payload
        return payload

    def all_gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """In-place sum over ranks."""
        if self.world_size > 1:
            moved = tensor.to(self.device)
            torch.distributed.all_reduce(moved)
            tensor.copy_(moved.cpu())

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """In-place maximum over ranks."""
        if self.world_size > 1:
            moved = tensor.to(self.device)
            torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.MAX)
            tensor.copy_(moved.cpu())

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def device_type() -> str:
    """ "cuda" when a GPU is usable and DeepSpeed is not forced onto the CPU, else "cpu"."""
    if launcher.cpu_forced() or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def end_launched_rank(code: int, stopped: bool = False) -> None:
    """End a rank started by the ``deepspeed`` launcher (RANK is set) with ``code`` once its work is
    done: flush, take the process group down, and leave through os._exit, before the interpreter's
    and the C++ libraries' teardown. A finished rank of a 2-rank CPU run sometimes died there with
    "terminate called without an active exception" (exit -6: a communication thread still joinable
    when its owner was destroyed), which the launcher reports as a failed run, even with the group
    destroyed first. Elsewhere (one process, a notebook) nothing happens here, unless the process
    was ``stopped`` by a signal: it must be gone within run.preempt_grace_s, which the interpreter's
    teardown (seconds on a busy machine) could outlast. Everything grpo_ds writes is closed before
    this (metrics, checkpoints, W&B)."""
    if not launcher.launched() and not stopped:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    _destroy_process_group()
    os._exit(code)


def init_distributed(
    tp_size: int = 1, sp_size: int = 1, rollout_ranks: int = 0, timeout_s: float = 600.0
) -> Dist:
    """Join (or, alone, create) the process group; idempotent so a notebook can train twice.
    ``tp_size`` / ``sp_size``: the tensor- / sequence-parallel sizes (train.*_parallel_size), which
    divide the world size (checked before). ``rollout_ranks`` K > 0 (split placement,
    grpo_ds.config.placement): the launch's last K ranks form a world of their own, the others the
    trainer's (grpo_ds.distributed.bridge says how); ``timeout_s`` bounds the wait for the split
    launch's store."""
    kind = device_type()
    if kind == "cpu":
        launcher.use_cpu_accelerator()
        local_ranks = launcher.local_ranks()
        # ranks sharing cores must not oversubscribe
        if local_ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))
    local_rank = launcher.local_rank()
    device = torch.device("cpu") if kind == "cpu" else torch.device("cuda", local_rank)
    if kind == "cuda":
        torch.cuda.set_device(device)
    if rollout_ranks:
        return _init_split(kind, device, tp_size, sp_size, rollout_ranks, timeout_s)
    import deepspeed

    _quiet_deepspeed(deepspeed)
    if not torch.distributed.is_initialized():
        backend = "gloo" if kind == "cpu" else "nccl"
        if launcher.launched():  # started by the `deepspeed` launcher (or torchrun)
            deepspeed.init_distributed(
                dist_backend=backend, auto_mpi_discovery=False, verbose=False
            )
        else:  # plain `python -m grpo_ds.train` or a notebook: a group of one on a free port
            # DeepSpeed asserts it; RANK/MASTER_PORT stay unset
            os.environ.setdefault("LOCAL_RANK", "0")
            # Without LOCAL_SIZE, DeepSpeed's CPU accelerator counts devices by spawning
            # `numactl --hardware`, which ZeRO-3 does on every gradient reduction (a fork of the
            # whole process, several per step).
            os.environ.setdefault("LOCAL_SIZE", "1")
            deepspeed.init_distributed(
                dist_backend=backend,
                auto_mpi_discovery=False,
                verbose=False,
                rank=0,
                world_size=1,
                init_method=f"tcp://127.0.0.1:{launcher.free_port()}",
            )
        # Take the group down while the interpreter is whole, in every process that made one (the
        # CLI, scripts, notebooks): left to the end of the process, its communication threads
        # sometimes outlived it ("terminate called without an active exception", exit -6 on a rank
        # of a run that had finished, under load).
        atexit.register(_destroy_process_group)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return Dist(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=device,
        tp_size=tp_size,
        sp_size=sp_size,
    )


def _quiet_deepspeed(deepspeed) -> None:
    # DeepSpeed calls collectives that torch has renamed; the warning is DeepSpeed's to fix, not the
    # user's.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)


def _init_split(
    kind: str,
    device: torch.device,
    tp_size: int,
    sp_size: int,
    rollout_ranks: int,
    timeout_s: float,
) -> Dist:
    """Split placement: the trainer's ranks join DeepSpeed's group of W-K ranks at MASTER_PORT
    (WORLD_SIZE is set to W-K for what reads it later); the rollout ranks join a group of their own
    on the store that the trainer's rank 0 serves (grpo_ds.distributed.bridge), which carries the
    bridge too. Launched ranks only (checked before)."""
    from grpo_ds.distributed import bridge

    launch_rank, world = launcher.rank(), launcher.world_size()
    trainers = world - rollout_ranks
    backend = "gloo" if kind == "cpu" else "nccl"
    if launch_rank < trainers:
        import deepspeed

        _quiet_deepspeed(deepspeed)
        store = (
            bridge.open_store(serve=launch_rank == 0, timeout_s=timeout_s)
            if launch_rank == 0
            else None
        )
        os.environ["WORLD_SIZE"] = str(trainers)
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            verbose=False,
            rank=launch_rank,
            world_size=trainers,
        )
        role, rank, size = "trainer", launch_rank, trainers
    else:
        store = bridge.open_store(serve=False, timeout_s=timeout_s)
        rank, size = launch_rank - trainers, rollout_ranks
        torch.distributed.init_process_group(
            backend,
            store=torch.distributed.PrefixStore("rollout", store),
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        role, tp_size, sp_size = "rollout", 1, 1
    atexit.register(_destroy_process_group)
    return Dist(
        rank=rank,
        world_size=size,
        local_rank=launcher.local_rank(),
        device=device,
        tp_size=tp_size,
        sp_size=sp_size,
        role=role,
        launch_rank=launch_rank,
        store=store,
    )
