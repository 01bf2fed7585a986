"""A checkpoint's ZeRO shards consolidated into one full fp32 state dict, for the export
(grpo_ds.export).

DeepSpeed's own ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` reads the
``ds/`` folder of a checkpoint written at any world size. A tensor-parallel run saved one set of
files per tensor-parallel rank (``mp_rank_XX``): each set is consolidated on its own and the
layers' slices are joined along the dimension AutoTP split.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from pathlib import Path

import torch

from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import device_type
from grpo_ds.errors import UserError, first_line
from grpo_ds.run.checkpoint import DS_TAG

_MP_RANK = re.compile(r"mp_rank_(\d+)")  # a tensor-parallel rank's files in a DeepSpeed checkpoint


def consolidate(
    folder: Path, frozen_excluded: bool = False, full_shapes: dict[str, torch.Size] | None = None
) -> dict[str, torch.Tensor]:
    """DeepSpeed's own ZeRO consolidation of ``folder/ds`` (any world size) into a full fp32 state
    dict (only the trainable weights when the checkpoint left the frozen ones out). A
    tensor-parallel run saved one set of files per tensor-parallel rank (``mp_rank_XX``): each set
    is consolidated on its own and the layers' slices are joined along the dimension AutoTP split
    (the one in which they add up to ``full_shapes``)."""
    mp_ranks = sorted(
        {int(m.group(1)) for f in (folder / DS_TAG).iterdir() if (m := _MP_RANK.search(f.name))}
    )
    if len(mp_ranks) <= 1:
        return _zero_consolidate(folder, frozen_excluded)
    parts = []
    for rank in mp_ranks:
        with tempfile.TemporaryDirectory(prefix="grpo_ds_tp_") as tmp:
            # this tensor-parallel rank's files only, as a checkpoint of its own
            view = Path(tmp) / DS_TAG
            view.mkdir()
            for f in (folder / DS_TAG).iterdir():
                if (m := _MP_RANK.search(f.name)) and int(m.group(1)) == rank:
                    (view / f.name).symlink_to(f.resolve())
            parts.append(_zero_consolidate(Path(tmp), frozen_excluded, shown=folder))
    return {
        name: _join_tensor_parallel(
            name, [p[name] for p in parts], (full_shapes or {}).get(name), folder
        )
        for name in parts[0]
    }


def _join_tensor_parallel(
    name: str, slices: list[torch.Tensor], full: torch.Size | None, folder: Path
) -> torch.Tensor:
    if full is None or slices[0].shape == full:  # replicated over the tensor-parallel group
        return slices[0]
    for dim in range(len(full)):
        others = all(
            s.shape[:dim] == full[:dim] and s.shape[dim + 1 :] == full[dim + 1 :] for s in slices
        )
        if others and sum(s.shape[dim] for s in slices) == full[dim]:
            return torch.cat(slices, dim)
    raise UserError(
        str(folder / DS_TAG),
        f"the tensor-parallel slices of {name} {[tuple(s.shape) for s in slices]} "
        f"do not make up its shape {tuple(full)}",
        "export with the recipe.json the run was trained with",
    )


def _zero_consolidate(
    folder: Path, frozen_excluded: bool, shown: Path | None = None
) -> dict[str, torch.Tensor]:
    if device_type() == "cpu":
        launcher.use_cpu_accelerator()  # read when deepspeed is first imported, hence imported here
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # It prints its progress (and tqdm bars) for a standalone script; the export prints its own
    # summary.
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            return get_fp32_state_dict_from_zero_checkpoint(
                str(folder), tag=DS_TAG, exclude_frozen_parameters=frozen_excluded
            )
    # a checkpoint DeepSpeed cannot read
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise UserError(
            str((shown or folder) / DS_TAG),
            f"DeepSpeed cannot consolidate it ({first_line(err)})",
            "export another checkpoint with --step",
        ) from None
