"""Stream full weights out of a ZeRO-3 engine in buckets.

ZeRO-3 keeps 1/world of every parameter on each rank. To refresh a rollout engine, parameters are
all-gathered a bucket at a time (one coalesced collective per bucket of ~``bucket_bytes``, not one per
tensor), handed to the consumer, and released before the next bucket, so at most one bucket of full
weights exists beyond the shards. Every rank must iterate to the end (the gathers are collective).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _full_numel(param: torch.nn.Parameter) -> int:
    return getattr(param, "ds_numel", param.numel())


def gathered_named_parameters(module: torch.nn.Module, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every parameter; each tensor is valid only until the next yield."""
    import deepspeed

    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, param in module.named_parameters():
        bucket.append((name, param))
        size += _full_numel(param) * param.element_size()
        if size >= bucket_bytes:
            yield from _gather_bucket(bucket, deepspeed)
            bucket, size = [], 0
    if bucket:
        yield from _gather_bucket(bucket, deepspeed)


def _gather_bucket(bucket: list[tuple[str, torch.nn.Parameter]], deepspeed) -> Iterator[tuple[str, torch.Tensor]]:
    sharded = [p for _, p in bucket if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None, enabled=bool(sharded)):
        for name, param in bucket:
            yield name, param.data
