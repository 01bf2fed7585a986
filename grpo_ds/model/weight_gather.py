"""Stream full weights out of a ZeRO-3 engine in buckets: the one exporter every rollout engine
consumes.

ZeRO-3 keeps 1/world of every parameter on each rank: ``param.ds_tensor`` is rank r's slice
``[r * s, (r + 1) * s)`` of the flattened parameter, zero-padded to ``world * s`` elements. To
refresh a rollout engine, the parameters are taken a bucket at a time; the bucket's local slices are
packed side by side into this rank's row of one ``(world, S)`` buffer and filled in by ONE
``all_gather_into_tensor`` (in place, as FSDP does), so a sync costs one collective per bucket
instead of one per tensor (TRL and OpenRLHF gather tensor by tensor, each gather a blocking
collective). Parameter i then sits in columns ``[o_i, o_i + s_i)`` of every row; it is copied out
(cast to the consumer's dtype in the same copy) and yielded as (name, tensor).

Memory: at most one bucket of gathered weights is alive at a time. A bucket is planned so that its
gathered buffer plus the one unpacked tensor being handed out stay within ``bucket_bytes``; the
unpacked copy is freed when the consumer asks for the next tensor, and the buffer before the next
bucket is gathered (their storage is released with ``resize_(0)``, so a stray reference cannot keep
them alive). A tensor is therefore valid only until the next one is requested: a consumer copies it
(a rollout engine's load) or clones it. A single parameter larger than ``bucket_bytes`` travels
alone as a view of its own gathered buffer (plus a cast copy if the dtype changes).

Names, tied weights, dtypes: names are the trainer module's (transformers' names, which vLLM's
``load_weights`` also takes: it maps q/k/v onto its fused qkv_proj itself). ``rename`` maps a name
to the consumer's (None drops the tensor), for consumers whose names differ or trainers whose module
is wrapped. A parameter shared by several names (tied input and output embeddings) is gathered once
and sent once under its first name (``tied="once"``: what the hf engine, whose own copy shares the
tensor, and vLLM, whose loaders skip ``lm_head.weight`` when ``tie_word_embeddings`` is set, need)
or under every name (``tied="all"``: for a consumer that stores the names separately). ``dtype``
casts to the rollout dtype during the unpacking copy; None keeps the training dtype (vLLM casts
while copying into its own parameters anyway).

Parameters that are not plain ZeRO-3 shards (quantized ZeRO++ weights, NVMe-offloaded partitions
that are swapped out) are gathered with DeepSpeed's own ``GatheredParameters`` a bucket at a time;
parameters outside ZeRO (no ``ds_id``) are already whole and are yielded as they are. Parameters of
layers that AutoTP split over a tensor-parallel group are gathered one layer at a time, over ZeRO
(``GatheredParameters``) and then over the tensor-parallel group (DeepSpeed's
``GatherReplacedLayerParams``), as DeepSpeed's own consolidation does. Every rank must iterate to
the end: the gathers are collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

TIED_MODES = ("once", "all")


@dataclass(frozen=True)
class _Item:
    """One parameter to export, with what the bucket planner needs to know."""

    param: torch.nn.Parameter
    names: tuple[str, ...]  # every name the module gives it (several: tied weights)
    # "shard" (plain ZeRO-3 slice), "zero" (other ZeRO-3 parameter), "whole" (not partitioned)
    kind: str
    key: tuple  # a bucket holds items with one key: same kind, process group, shard dtype
    gathered_bytes: int  # bytes of its gathered, padded buffer
    unpacked_bytes: int  # bytes of its unpacked copy in the output dtype
    # handed out as a private copy: the output dtype differs from the gathered one, or it was asked
    copied: bool
    # memory the consumer holds while this item is handed out (counted in the bucket)
    extra_bytes: int = 0
    layer: torch.nn.Module | None = None  # kind "tp": the AutoTP layer that owns it


def gathered_named_parameters(
    module: torch.nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    rename: Callable[[str], str | None] | None = None,
    tied: str = "once",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every parameter of ``module``, bucket by bucket (see the module
    docstring).

    ``dtype``: cast to this dtype (None = keep); ``rename``: trainer name -> consumer name, None to
    skip it; ``tied``: "once" or "all" (a tensor shared by several names). A parameter all of whose
    names ``rename`` drops is not gathered at all. Each tensor is valid until the next one is
    requested. Every rank must consume the whole iterator.
    """
    if tied not in TIED_MODES:
        raise ValueError(f"tied must be one of {TIED_MODES}, got {tied!r}")
    chosen = []
    layers = {
        id(p): m
        for m in module.modules()
        for p in m.parameters(recurse=False)
        if getattr(p, "ds_is_replaced_module", False)
    }  # AutoTP layers
    for param, names in _parameters_with_names(module):
        sent = names if tied == "all" else names[:1]
        targets = tuple(rename(n) if rename is not None else n for n in sent)
        # a parameter every name of which is dropped is never gathered
        if any(t is not None for t in targets):
            chosen.append((param, tuple(t for t in targets if t is not None)))
    for names, tensor in gathered_parameters(chosen, bucket_bytes, dtype, layers=layers):
        for name in names:
            yield name, tensor


def gathered_parameters(
    parameters: list[tuple[torch.nn.Parameter, tuple]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    private: frozenset[int] = frozenset(),
    extra_bytes: dict[int, int] | None = None,
    layers: dict[int, torch.nn.Module] | None = None,
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Yield (tag, full tensor) for each (parameter, tag) in the given order, bucket by bucket.

    The lower layer of ``gathered_named_parameters``, for consumers that choose the order themselves
    (LoRA merges need a layer's adapters before its weight). Parameters whose id is in ``private``
    are handed out as a copy the consumer may modify in place (counted in the bucket plan, like a
    cast); ``extra_bytes[id(param)]`` is memory the consumer holds while that parameter is out (also
    counted); ``layers[id(param)]`` is the AutoTP layer of a tensor-parallel parameter. Same
    validity rule: until the next request.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    extra, layers = extra_bytes or {}, layers or {}
    items = [
        _describe(
            param, tag, dtype, id(param) in private, extra.get(id(param), 0), layers.get(id(param))
        )
        for param, tag in parameters
    ]
    for bucket in _plan_buckets(items, bucket_bytes):
        for item, tensor in _gather_bucket(bucket, dtype):
            yield item.names, tensor


def _plan_buckets(items: list[_Item], bucket_bytes: int) -> list[list[_Item]]:
    """Consecutive items grouped so that a bucket's gathered bytes plus its largest unpacked copy
    fit in ``bucket_bytes``; items of different kinds or process groups never share a bucket; an
    item too large for any bucket travels alone. Items that need no gather ("whole") go one per
    bucket."""
    buckets: list[list[_Item]] = []
    current: list[_Item] = []
    for item in items:
        if current and (
            item.key != current[0].key
            or item.kind == "whole"
            or (item.kind != "tp" and _bucket_cost(current + [item]) > bucket_bytes)
        ):
            buckets.append(current)
            current = []
        current.append(item)
    if current:
        buckets.append(current)
    return buckets


def _bucket_cost(bucket: list[_Item]) -> int:
    """Gathered bytes, plus the largest unpacked copy when one is made (several items, or a
    cast)."""
    gathered = sum(i.gathered_bytes for i in bucket)
    copies = (
        max(i.unpacked_bytes for i in bucket)
        if len(bucket) > 1 or any(i.copied for i in bucket)
        else 0
    )
    return gathered + copies + sum(i.extra_bytes for i in bucket)


def _parameters_with_names(
    module: torch.nn.Module,
) -> list[tuple[torch.nn.Parameter, tuple[str, ...]]]:
    """Each distinct parameter once, in module order, with all of its names (tied weights have
    several)."""
    names: dict[int, list[str]] = {}
    order: list[torch.nn.Parameter] = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in names:
            names[id(param)] = []
            order.append(param)
        names[id(param)].append(name)
    return [(p, tuple(names[id(p)])) for p in order]


def _is_plain_shard(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 parameter whose local slice is resident and unquantized (the common case)."""
    shard = getattr(param, "ds_tensor", None)
    return (
        shard is not None
        and hasattr(param, "ds_process_group")
        and not hasattr(shard, "ds_quant_scale")
        and shard.numel() == getattr(shard, "ds_numel", -1)
        and shard.numel() > 0
    )


def _describe(
    param: torch.nn.Parameter,
    names: tuple,
    dtype: torch.dtype | None,
    private: bool = False,
    extra_bytes: int = 0,
    layer: torch.nn.Module | None = None,
) -> _Item:
    out_size = torch.empty((), dtype=dtype or param.dtype).element_size()
    copied = private or (dtype is not None and dtype != param.dtype)
    # an AutoTP layer's parameter: its layer travels alone (one bucket per layer)
    if layer is not None:
        numel = getattr(param, "ds_numel", param.numel()) * layer.tp_world_size
        return _Item(
            param,
            names,
            "tp",
            ("tp", id(layer)),
            numel * param.element_size(),
            numel * out_size,
            copied,
            extra_bytes,
            layer,
        )
    if not hasattr(param, "ds_id"):
        return _Item(
            param,
            names,
            "whole",
            ("whole",),
            0,
            param.numel() * out_size if copied else 0,
            copied,
            extra_bytes,
        )
    if _is_plain_shard(param):
        import deepspeed.comm as ds_comm

        group, shard = param.ds_process_group, param.ds_tensor
        padded = shard.ds_numel * ds_comm.get_world_size(group=group)
        return _Item(
            param,
            names,
            "shard",
            ("shard", id(group), shard.dtype),
            padded * shard.element_size(),
            padded * out_size,
            private or (dtype is not None and dtype != shard.dtype),
            extra_bytes,
        )
    return _Item(
        param,
        names,
        "zero",
        ("zero", param.dtype),
        param.ds_numel * param.element_size(),
        param.ds_numel * out_size,
        copied,
        extra_bytes,
    )


def _gather_bucket(
    bucket: list[_Item], dtype: torch.dtype | None
) -> Iterator[tuple[_Item, torch.Tensor]]:
    """(item, its full tensor) for every item of the bucket; plain shards take one collective for
    the bucket."""
    kind = bucket[0].kind
    if kind == "whole":
        yield from _handed_out(bucket[0], bucket[0].param.data, dtype, copy=False)
    elif kind == "shard":
        yield from _gather_shards(bucket, dtype)
    elif kind == "tp":
        import deepspeed
        from deepspeed.module_inject.layers import GatherReplacedLayerParams

        # a row-parallel layer gathers its weight first
        params = list(bucket[0].layer.parameters(recurse=False))
        with (
            deepspeed.zero.GatheredParameters(params, modifier_rank=None),
            GatherReplacedLayerParams(params, bucket[0].layer),
        ):
            for item in bucket:
                yield from _handed_out(item, item.param.data, dtype, copy=False)
    else:
        import deepspeed

        with deepspeed.zero.GatheredParameters([i.param for i in bucket], modifier_rank=None):
            for item in bucket:
                yield from _handed_out(item, item.param.data, dtype, copy=False)


def _handed_out(
    item: _Item, tensor: torch.Tensor, dtype: torch.dtype | None, copy: bool
) -> Iterator[tuple[_Item, torch.Tensor]]:
    """Yield ``tensor`` (cast when asked, copied when the item is private); a copy is released as
    soon as the consumer asks for the next one."""
    if (dtype is not None and dtype != tensor.dtype) or (item.copied and not copy):
        tensor, copy = tensor.to(dtype or tensor.dtype, copy=True), True
    try:
        yield item, tensor
    finally:
        if copy:
            _release(tensor)


def _release(tensor: torch.Tensor) -> None:
    """Free a buffer now, even if a consumer still holds a view of it (tensors are valid until the
    next one). A storage shared with numpy cannot be resized; it is left to reference counting."""
    try:
        tensor.untyped_storage().resize_(0)
    except RuntimeError:
        pass


def _gather_shards(
    bucket: list[_Item], dtype: torch.dtype | None
) -> Iterator[tuple[_Item, torch.Tensor]]:
    import deepspeed.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    group, shard_dtype = bucket[0].param.ds_process_group, bucket[0].param.ds_tensor.dtype
    world, rank = ds_comm.get_world_size(group=group), ds_comm.get_rank(group=group)
    sizes = [i.param.ds_tensor.ds_numel for i in bucket]  # s_i: each rank's slice of parameter i
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    width = sum(sizes)  # S
    device = torch.device(get_accelerator().current_device_name())
    flat = torch.empty(world * width, dtype=shard_dtype, device=device)  # (world * S,)
    # row r: rank r's slices of every parameter of the bucket, side by side
    rows = flat.view(world, width)
    out_dtype = dtype or shard_dtype
    try:
        for item, offset, size in zip(bucket, offsets, sizes, strict=True):
            rows[rank, offset : offset + size].copy_(item.param.ds_tensor.reshape(-1))
        if world > 1:  # in place (as FSDP): this rank's input is its own row of the output
            ds_comm.all_gather_into_tensor(flat, rows[rank], group=group)
        for item, offset, size in zip(bucket, offsets, sizes, strict=True):
            p = item.param
            # (world, s_i): the padded parameter, rank-major
            columns = rows[:, offset : offset + size]
            # alone in its bucket, or world size 1; no copy asked
            if columns.is_contiguous() and not item.copied:
                yield from _handed_out(
                    item, columns.reshape(-1)[: p.ds_numel].view(p.ds_shape), None, copy=False
                )
            else:
                whole = torch.empty(world * size, dtype=out_dtype, device=device)
                whole.view(world, size).copy_(columns)  # unpack and cast in one copy
                yield from _handed_out(item, whole[: p.ds_numel].view(p.ds_shape), None, copy=True)
    finally:
        _release(flat)
