"""Export a training checkpoint as a Hugging Face model folder that transformers loads on its own.

    python -m grpo_ds.export RUN_DIR --out DIR [--step N] [--dtype float32|bfloat16|float16]
        [--merge] [--overwrite]
    python -m grpo_ds.export RUN_DIR --list

A run folder holds ``recipe.json`` and ``checkpoints/step_XXXXXXXX/`` folders (``ds/`` written by
DeepSpeed, ``trainer_state.json``, ``manifest.json`` with the sha256 of every file);
``checkpoints/latest`` names the newest complete one, and ``.tmp-*`` folders are unfinished writes,
never read. The export:

1. picks the checkpoint: ``--step N``, else the one ``latest`` names, else the highest step;
2. verifies every file against ``manifest.json`` (a damaged checkpoint is reported by file name
   before any tensor is read);
3. consolidates the ZeRO-3 shards into one fp32 state dict with DeepSpeed's own
   ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (any world size);
4. rebuilds the model from ``recipe.json`` (builtin:tiny, or the local HF folder's config; a
   Hugging Face Hub id is read from the Hugging Face cache, fetched there if missing), loads the
   state dict strictly (a tied ``lm_head.weight`` may be absent), casts it to ``--dtype``
   (default: the recipe's ``model.dtype``);
5. writes ``config.json`` + ``model.safetensors``, the tokenizer and ``generation_config.json`` into
   a temporary folder beside ``--out`` and renames it into place, so ``--out`` never holds half an
   export.

A LoRA run (``model.lora_rank``) checkpoints its adapters only. Its export rebuilds the base model
from ``model.path`` (builtin:tiny from ``run.seed``), puts the adapters on it with peft, and writes
either the adapter folder in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``,
plus the tokenizer: load it with ``PeftModel.from_pretrained(base, DIR)``), or with ``--merge`` the
merged model, which transformers loads alone.

Every mistake a user can make (wrong run folder, no checkpoints, unknown step, non-empty ``--out``,
damaged checkpoint) is a one-line ``error: ...`` with exit code 2, found before any model or tensor
is loaded. So is an export the free space of ``--out``'s file system cannot hold (refused before
writing), and a write that fails (a full disk, a read-only file system, a quota:
grpo_ds.run.writes), which leaves neither ``--out`` nor the temporary folder behind.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_ds.config import software
from grpo_ds.config.dtypes import DTYPES
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.recipe import ModelConfig
from grpo_ds.errors import UserError, exit_on_user_error
from grpo_ds.model import lora, rebuild
from grpo_ds.model.loading import check_model_path, load_tokenizer, torch_dtype
from grpo_ds.run import writes
from grpo_ds.run.checkpoint import (
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    StepFolder,
    latest_name,
    step_folders,
    verify,
)
from grpo_ds.run.consolidate import consolidate
from grpo_ds.run.folder import check_output_folder
from grpo_ds.run.hub import hub_model

TOKENIZER_BYTES = 16 << 20  # free space asked for the tokenizer and config files beside the weights


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint folder and, once verified, what is wrong with it (None: it verifies)."""

    step: int
    path: Path
    problem: str | None = None


@dataclass(frozen=True)
class ExportSummary:
    checkpoint: Path
    step: int
    out_dir: Path
    num_parameters: int
    dtype: str
    architecture: str
    adapter_only: bool = False  # a LoRA run's adapter folder (peft format), not a whole model


# ------------------------------------------------------------------------------ finding checkpoints


def checkpoint_folders(run_dir: str | Path) -> list[StepFolder]:
    """Every checkpoint folder of a run, oldest first (grpo_ds.run.checkpoint.step_folders).

    Raises UserError when ``run_dir`` is not a run folder or holds no checkpoint."""
    run = _check_run_dir(run_dir)
    found = step_folders(run)
    if not found:
        raise UserError(
            str(run / CHECKPOINTS),
            "no checkpoints in this run folder",
            "the run saved none yet (checkpoints are written every checkpoint.every_steps steps)",
        )
    return found


def select_checkpoint(run_dir: str | Path, step: int | None = None) -> StepFolder:
    """``step``'s checkpoint; without one, the checkpoint ``checkpoints/latest`` names, else the
    highest step."""
    found = checkpoint_folders(run_dir)
    steps = ", ".join(str(c.step) for c in found)
    if step is not None:
        for info in found:
            if info.step == step:
                return info
        raise UserError(
            "--step",
            f"no checkpoint of step {step} in {found[0].path.parent}",
            f"available steps: {steps}",
        )
    name = latest_name(Path(run_dir))
    if name is not None:
        for info in found:
            if info.path.name == name:
                return info
        raise UserError(
            str(found[0].path.parent / LATEST),
            f"names {name!r}, which is not a checkpoint folder here",
            f"pass --step with one of the available steps: {steps}",
        )
    return found[-1]


def _check_run_dir(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    if not run.is_dir():
        what = "is not a folder" if run.exists() else "no such run folder"
        raise UserError(
            str(run),
            what,
            "give a run folder (run.output_dir/run.name), the one holding recipe.json "
            "and checkpoints/",
        )
    if not (run / "recipe.json").is_file():
        raise UserError(
            str(run),
            "no recipe.json in it, so it is not a grpo_ds run folder",
            "give the run folder (run.output_dir/run.name), "
            "the one holding recipe.json and checkpoints/",
        )
    return run


# ---------------------------------------------------------------------------------------- verifying

verify_checkpoint = verify  # the one check, in grpo_ds.run.checkpoint


def list_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Every checkpoint of a run, oldest first, each verified against its manifest (``problem``
    None: good)."""
    return [
        CheckpointInfo(c.step, c.path, verify_checkpoint(c.path))
        for c in checkpoint_folders(run_dir)
    ]


# ---------------------------------------------------------------------------------------- exporting


def export_checkpoint(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    merge: bool = False,
) -> Path:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as a transformers folder
    ``out_dir``.

    ``dtype``: "float32", "bfloat16" or "float16" (default: the recipe's model.dtype). Returns
    ``out_dir``. A LoRA run gives its adapter folder (peft format), or the merged model with
    ``merge``. Raises UserError for anything the user can fix; ``out_dir`` is untouched unless the
    export succeeds."""
    return export(run_dir, out_dir, step, dtype, overwrite, merge).out_dir


def export(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    merge: bool = False,
) -> ExportSummary:
    """``export_checkpoint`` returning what was done (for the command line's summary)."""
    run = _check_run_dir(run_dir)
    model_cfg, seed = _model_config(run)
    use_lora = _uses_lora(model_cfg, merge)
    checkpoint = select_checkpoint(run, step)
    out = _check_out_dir(Path(out_dir).resolve(), run, overwrite)
    dtype = dtype or model_cfg.dtype
    if dtype not in DTYPES:
        raise UserError(
            "--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}", "pick one of them"
        )
    model_cfg = _model_source(model_cfg, run)
    # cheap, and its errors (no tokenizer files) come before the hashing
    tokenizer = load_tokenizer(model_cfg)
    _check_verifies(checkpoint, run)

    model = _trained_model(model_cfg, seed, len(tokenizer), checkpoint.path, use_lora, merge)
    model.to(torch_dtype(dtype))
    model.eval()
    adapter_only = use_lora and not merge
    generation_config = rebuild.generation_config(model_cfg, model, tokenizer)
    saved = (
        [p for p in model.parameters() if p.requires_grad]
        if adapter_only
        else list(model.parameters())
    )
    _write(
        out,
        model,
        tokenizer,
        None if adapter_only else generation_config,
        sum(p.nbytes for p in saved),
    )
    return ExportSummary(
        checkpoint=checkpoint.path,
        step=checkpoint.step,
        out_dir=out,
        num_parameters=sum(p.numel() for p in saved),
        dtype=dtype,
        architecture=f"LoRA adapters (rank {model_cfg.lora_rank}) for "
        f"{type(model.get_base_model()).__name__}"
        if adapter_only
        else type(model).__name__,
        adapter_only=adapter_only,
    )


def _uses_lora(model_cfg: ModelConfig, merge: bool) -> bool:
    """Whether the run trained LoRA adapters (then peft must be installed); ``--merge`` needs
    them."""
    use_lora = lora.enabled(model_cfg)
    if merge and not use_lora:
        raise UserError(
            "--merge",
            "this run trained every weight (no model.lora_rank): there is nothing to merge",
            "leave --merge out",
        )
    if use_lora:
        software.check_peft()
    return use_lora


def _check_verifies(checkpoint: StepFolder, run: Path) -> None:
    """The checkpoint's files against its manifest; a damaged one names the older steps to export
    instead."""
    problem = verify_checkpoint(checkpoint.path)
    if problem:
        older = [str(c.step) for c in checkpoint_folders(run) if c.step < checkpoint.step]
        fix = (
            "export an older checkpoint with --step (steps before "
            f"it: {', '.join(older)}; --list verifies them)"
            if older
            else "there is no older checkpoint to export instead; restore this one from a backup"
        )
        raise UserError(str(checkpoint.path), problem, fix)


def _trained_model(
    model_cfg: ModelConfig, seed: int, vocab_size: int, folder: Path, use_lora: bool, merge: bool
) -> torch.nn.Module:
    """The model in fp32 with the weights of checkpoint ``folder``: a LoRA run's base model with its
    adapters (merged in with ``merge``), else the whole model."""
    if use_lora:
        adapters = consolidate(folder, frozen_excluded=True)
        model = rebuild.lora_model(model_cfg, seed, vocab_size, adapters, folder)
        return model.merge_and_unload() if merge else model
    model = rebuild.build_model(model_cfg, vocab_size)
    state_dict = consolidate(
        folder, full_shapes={n: t.shape for n, t in model.state_dict().items()}
    )
    rebuild.load_strict(model, state_dict, folder)
    return model


def _write(out: Path, model, tokenizer, generation_config, weight_bytes: int) -> None:
    """Write the folder beside ``out`` and rename it into place. Too little free space for the
    weights is refused before writing; a failed write (full disk, read-only, quota) is one
    UserError, with nothing left behind."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        writes.check_space(
            "export",
            out.parent,
            int(weight_bytes * (1 + writes.SPACE_MARGIN)) + TOKENIZER_BYTES,
            f"the model ({writes.gib(weight_bytes)} of weights)",
            "free space and run the export again",
        )
        # an existing out: empty, or --overwrite
        with writes.folder_written(out) as tmp, writes.writing(tmp):
            # transformers draws a progress bar per shard
            with contextlib.redirect_stderr(io.StringIO()):
                model.save_pretrained(tmp)  # a peft model writes its adapters only
            tokenizer.save_pretrained(tmp)
            if generation_config is not None:
                generation_config.save_pretrained(tmp)
    except OSError as err:
        raise UserError(
            "export",
            f"cannot write {err.filename or out}: {writes.describe(err)}",
            f"nothing was written to {out}; {writes.remedy(err)} and run the export again",
        ) from None


def _model_config(run: Path) -> tuple[ModelConfig, int]:
    """The run's model section and run.seed (builtin:tiny's base weights come from it), read once
    and validated; only those: the export must not fail on, say, a dataset that has moved since."""
    path = run / "recipe.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(
            f"{path}:{err.lineno}:{err.colno}",
            f"invalid JSON ({err.msg})",
            "restore the recipe.json the run wrote",
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise UserError(
            str(path), 'has no "model" section', "restore the recipe.json the run wrote"
        )
    seed = raw["run"].get("seed", 0) if isinstance(raw.get("run"), dict) else 0
    try:
        recipe = load_recipe({"model": raw["model"], "run": {"seed": seed}})
    except UserError as err:
        raise UserError(f"{path}: {err.where}", err.what, err.fix) from None
    return recipe.model, recipe.run.seed


def _model_source(model_cfg: ModelConfig, run: Path) -> ModelConfig:
    """The run's model section, checked, with a Hub id in model.path replaced by its folder in the
    Hugging Face cache (grpo_ds.run.hub: fetched there if missing)."""
    try:
        folder = hub_model("model.path", model_cfg.path, model_cfg.revision, "model.revision")
    except UserError as err:
        raise UserError(f"{run / 'recipe.json'}: {err.where}", err.what, err.fix) from None
    if folder is not None:
        model_cfg = dataclasses.replace(model_cfg, path=str(folder))
    try:
        check_model_path(model_cfg)
    except UserError as err:
        raise UserError(
            f"{run / 'recipe.json'}: {err.where}",
            err.what,
            "the export rebuilds the model from it: run the export from the folder training ran in "
            "(a relative model.path is read from there), or restore the model folder",
        ) from None
    return model_cfg


def _check_out_dir(out: Path, run: Path, overwrite: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise UserError("--out", f"{out} exists and is not a folder", "give a new folder")
    check_output_folder(out, "--out")  # a file on the way, or a folder that cannot be written
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                "--out", f"{out} exists and is not empty", "give a new folder, or pass --overwrite"
            )
        resolved, run_resolved = out.resolve(), run.resolve()
        if resolved == run_resolved or resolved in run_resolved.parents:
            raise UserError(
                "--out",
                f"{out} holds the run folder, which --overwrite would delete",
                "give a folder outside the run",
            )
    return out


# ------------------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's two-line usage error becomes the one-line contract
        raise UserError(self.prog, message, "see --help")


def _print_list(run_dir: str) -> None:
    infos = list_checkpoints(run_dir)
    latest = latest_name(Path(run_dir))
    print(f"checkpoints in {infos[0].path.parent}:")
    for info in infos:
        state, problem = ("ok", "") if info.problem is None else ("DAMAGED", f": {info.problem}")
        mark = " (latest)" if info.path.name == latest else ""
        print(f"  step {info.step:>8}  {state:<7}  {info.path.name}{mark}{problem}")


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(
        prog="python -m grpo_ds.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="the run folder (holds recipe.json and checkpoints/)")
    parser.add_argument(
        "--out", help="folder to write the model into (new or empty, unless --overwrite)"
    )
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the latest)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="dtype of the saved weights (default: the recipe's model.dtype)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: write the base model with the adapters "
        "merged in (default: the adapter folder, peft format)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument(
        "--list", action="store_true", help="list the checkpoints and whether each verifies"
    )
    with exit_on_user_error():
        args = parser.parse_args(argv)
        if args.list:
            _print_list(args.run_dir)
            return
        if not args.out:
            raise UserError(
                parser.prog,
                "--out is required",
                "give the folder to write the model into, or --list",
            )
        done = export(args.run_dir, args.out, args.step, args.dtype, args.overwrite, args.merge)
        print(f"checkpoint: {done.checkpoint} (step {done.step}, verified against {MANIFEST})")
        print(f"model:      {done.architecture}, {done.num_parameters:,} parameters, {done.dtype}")
        how = (
            "PeftModel.from_pretrained(base model, DIR); --merge writes a whole model"
            if done.adapter_only
            else "AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained"
        )
        print(f"written:    {done.out_dir} (load it with {how})")


if __name__ == "__main__":
    main()
