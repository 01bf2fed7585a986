"""Resume on another world size: DeepSpeed's universal checkpoint, made from a run's own checkpoint
when needed.

A checkpoint holds the ZeRO partitions of the world size that wrote it. To resume at another one,
rank 0 converts the checkpoint's ``ds/`` folder with DeepSpeed's own converter
(deepspeed/checkpoint/ds_to_universal.py) into ``ds_universal/`` beside it: per parameter, its fp32
weight and Adam moments, whole. Every rank then loads that with DeepSpeed's
``load_universal_checkpoint``, which partitions the states for the new world size. Nothing of the
format is grpo_ds's own. The conversion is done once per checkpoint, into a temporary folder renamed
at the end, and it costs about 1.6x the checkpoint's size on disk.

DeepSpeed 0.19.8's converter writes a folder that only an engine of the ZeRO stage it came from can
load, and a one-rank run trains with stage 1 where two or more ranks train with stage 3
(grpo_ds.config.deepspeed.one_rank_stage). ``_normalize`` therefore makes the converted folder
loadable by both stages:
- both names of the model-states file: stage 3 looks for
  ``zero_pp_rank_0_mp_rank_00_model_states.pt``, stages 1-2 for ``mp_rank_00_model_states.pt``;
- the stage 3 converter's flat tensors wrapped as ``{"param": tensor}``, as the stage 1-2 loader
  reads them;
- the optimizer step, which stage 1-2 reads from each parameter's ``step.pt`` and stage 3 from the
  optimizer state
  dict;
- ``ds_version`` in ``zero/optimizer_state.pt``, which the stage 1-2 loader asserts.

What was measured with these (W=2 ZeRO-3 <-> W=1 stage 1): the fp32 weights, both Adam moments, the
step and the lr schedule come back bit for bit, and the next step matches an uninterrupted run at
the new world size to the rounding of its gradient reductions. Tensor and sequence parallelism and
ZeRO offload change what a partition is, and are refused before anything loads (``layout_problem``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from grpo_ds.config.deepspeed_keys import offloaded
from grpo_ds.run import writes

UNIVERSAL_TAG = "ds_universal"


def saved_world_size(checkpoint: Path, ds_tag: str) -> int | None:
    """The world size that wrote ``checkpoint``: recorded in its trainer state, or (a checkpoint
    from before it was recorded) the number of ZeRO optimizer partitions in its DeepSpeed folder;
    None when neither says."""
    try:
        recorded = json.loads((checkpoint / "trainer_state.json").read_text()).get("world_size")
    except (OSError, ValueError):
        recorded = None
    if recorded is not None:
        return int(recorded)
    partitions = list((checkpoint / ds_tag).glob("*_optim_states.pt"))
    return len(partitions) or None


def layout_problem(recipe, ds_config: dict) -> str | None:
    """Why a run with this layout cannot resume a checkpoint of another world size, None when it
    can."""
    t = recipe.train
    zero = ds_config.get("zero_optimization") or {}
    if t.tensor_parallel_size > 1:
        return (
            f"train.tensor_parallel_size {t.tensor_parallel_size} "
            "(AutoTP splits the layers a partition holds)"
        )
    if t.sequence_parallel_size > 1:
        return f"train.sequence_parallel_size {t.sequence_parallel_size}"
    for part in ("offload_optimizer", "offload_param"):
        if offloaded(zero, part):
            return f"ZeRO {part.replace('_', ' ')} to {zero[part]['device']}"
    return None


def ensure(checkpoint: Path, ds_tag: str) -> Path:
    """Rank 0: the checkpoint's universal folder, converted (and normalized) now unless an earlier
    resume did it."""
    out = checkpoint / UNIVERSAL_TAG
    if (out / "zero" / "optimizer_state.pt").is_file():
        return out
    from deepspeed.checkpoint import ds_to_universal

    with writes.folder_written(out) as tmp:  # an interrupted conversion leaves no partial folder
        # progress bars
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # a stage 1-2 checkpoint records no universal_checkpoint_info
            ds_to_universal.main(
                argparse.Namespace(
                    input_folder=str(checkpoint / ds_tag),
                    output_folder=str(tmp),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=True,
                )
            )
        # the converter's pointer; the tag is always given
        (checkpoint / "latest_universal").unlink(missing_ok=True)
        _normalize(tmp)
    return out


@contextlib.contextmanager
def loading(engine) -> Iterator[None]:
    """The engine reads a universal checkpoint for the duration (DeepSpeed reads this config flag at
    load time)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def _normalize(folder: Path) -> None:
    """Make a converted folder loadable by a ZeRO stage 1-2 engine and by a stage 3 one (module
    docstring)."""
    import deepspeed
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    zero = folder / "zero"
    state_path = zero / "optimizer_state.pt"
    state = torch.load(state_path, weights_only=False)
    params = sorted(p for p in zero.iterdir() if p.is_dir())
    if OPTIMIZER_STATE_DICT in state:  # from stage 3: the step is in the optimizer state dict
        step = state[OPTIMIZER_STATE_DICT]["state"][0]["step"]
        state.pop("fp32_flat_groups", None)  # rank 0's whole partition again; no loader reads it
    else:  # from stage 1-2: the step is in every parameter's step.pt
        step = torch.load(params[0] / "step.pt", weights_only=False)
        state[OPTIMIZER_STATE_DICT] = {
            "state": {0: {"step": step}},
            PARAM_GROUPS: state[PARAM_GROUPS],
        }
    state.setdefault("ds_version", deepspeed.__version__)
    torch.save(state, state_path)
    for param in params:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = param / f"{key}.pt"
            if path.is_file() and torch.is_tensor(value := torch.load(path, weights_only=False)):
                torch.save({PARAM: value}, path)
        if not (param / "step.pt").is_file():
            torch.save(step, param / "step.pt")
    stage3, stage1 = (
        folder / "zero_pp_rank_0_mp_rank_00_model_states.pt",
        folder / "mp_rank_00_model_states.pt",
    )
    if stage3.is_file() and not stage1.is_file():
        shutil.copy2(stage3, stage1)
    elif stage1.is_file() and not stage3.is_file():
        shutil.copy2(stage1, stage3)
