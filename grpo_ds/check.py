"""Dry run: validate a recipe for a world size and print the environment and the batch plan, without
loading a model.

    python -m grpo_ds.check RECIPE.json --world-size 8 [section.key=value ...]

The validation is grpo_ds.run.preflight.prepare_inputs, the same one ``grpo_ds.train`` runs first;
this module is the report only. Under split placement (rollout.placement "split",
grpo_ds.config.placement) the batch algebra, the shards and the memory estimate are the trainer's
ranks' (W - rollout.ranks), and one more line estimates a rollout rank. Each reward model
(reward.models) is counted in the estimate and listed with its parameters and its share.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from grpo_ds.config import software
from grpo_ds.config.deepspeed import load_deepspeed_json, one_rank_stage_note, rollout_shares_policy
from grpo_ds.config.deepspeed_keys import zero_stage
from grpo_ds.config.placement import Placement
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import device_type
from grpo_ds.errors import exit_on_user_error
from grpo_ds.kernels import chunk_bytes_per_token, chunk_tokens_for
from grpo_ds.model import lora, memory
from grpo_ds.model.memory import GIB
from grpo_ds.run.preflight import Inputs, prepare_inputs
from grpo_ds.step.memory_fit import (
    estimate_memory,
    fit_lines,
    prompts_per_generate_call,
    static_cache,
)
from grpo_ds.step.plan import StepPlan, old_logprob_pass_reason, plan_recipe_step, token_imbalance


def simulated_lengths(inputs: Inputs, mode: str) -> list[int]:
    """Sequence lengths (prompt + completion) for one step: real prompt lengths from the dataset,
    completions uniform in [1, the response limit] ("uniform") or all at the limit ("max"); the
    limit is max_new_tokens, or an agent's max_total_tokens."""
    recipe = inputs.recipe
    rng = np.random.default_rng(recipe.run.seed)
    prompt_lengths = [len(p.prompt_ids) for p in inputs.prompts]
    out = []
    for _ in range(recipe.rollout.prompts_per_step):
        prompt = prompt_lengths[int(rng.integers(len(prompt_lengths)))]
        for _ in range(recipe.rollout.group_size):
            top = recipe.max_response_tokens
            new = top if mode == "max" else int(rng.integers(1, top + 1))
            out.append(prompt + new)
    return out


def environment_lines(env: software.InstalledSoftware, device_type: str) -> list[str]:
    """The "environment" block: the checklist a GRPO guide starts with (grpo_ds.config.software
    collects it)."""
    v = env.versions
    build = (
        f"CUDA {env.cuda}"
        if env.cuda and not env.cuda.startswith("ROCm")
        else env.cuda or "CPU build"
    )
    lines = [
        "environment",
        f"  {'python':<13} {env.python}",
        f"  {'torch':<13} {v['torch']} ({build}" + (f", NCCL {env.nccl})" if env.nccl else ")"),
    ]
    lines += [
        f"  {name:<13} {v[name] or 'not installed'}"
        for name in software.PACKAGES
        if name != "torch"
    ]
    if env.gpus:
        names = sorted(set(env.gpus), key=env.gpus.index)
        gpus = ", ".join(f"{env.gpus.count(n)} x {n}" for n in names)
    else:
        gpus = "none visible to torch"
    driver = f"; NVIDIA driver {env.driver}" if env.driver else ""
    used = "GPU" if device_type == "cuda" else "CPU" + (" (DS_ACCELERATOR=cpu)" if env.gpus else "")
    lines.append(f"  {'accelerator':<13} {used} (GPUs: {gpus}{driver})")
    have = ", ".join(extra for extra, on in env.extras.items() if on) or "none"
    missing = ", ".join(extra for extra, on in env.extras.items() if not on) or "none"
    lines.append(f"  {'extras':<13} installed: {have}; not installed: {missing}")
    lines += [f"  {'conflict':<13} {unmet}" for unmet in env.unmet] or [
        f"  {'conflicts':<13} none declared"
    ]
    return lines


def report(
    inputs: Inputs, world_size: int, lengths_mode: str, gpu_memory_gib: float | None = None
) -> str:
    """The dry run's report, one section after another in the order it prints: the layout, the
    batch algebra, the shards of optimizer step 1, the resolved DeepSpeed keys, the kernels and the
    rollout engine, the memory estimate, the reward models and the dataset."""
    r, placement = inputs.recipe, inputs.placement
    lengths = simulated_lengths(inputs, lengths_mode)
    # the world the batch algebra and DeepSpeed see (all ranks when colocated)
    ranks = (
        f"trainer ranks {placement.trainer_ranks}"
        if placement.split
        else f"world size {world_size}"
    )
    dp = placement.trainer_ranks // r.train.tensor_parallel_size // r.train.sequence_parallel_size
    plan = plan_recipe_step(r, lengths, dp, step=1)
    lines = [
        f"recipe is valid for world size {world_size}",
        f"placement: {placement.describe()}",
        _layout_line(r, ranks, dp),
        "",
        *_batch_algebra_lines(r),
        "",
        *_shard_lines(r, plan, lengths, lengths_mode),
    ]
    shape = memory.model_shape(r, len(inputs.tokenizer))
    lines += [
        "",
        *_deepspeed_lines(r, inputs.ds_config, ranks, dp),
        "",
        _kernels_line(inputs, shape.vocab),
        _rollout_line(r, inputs.ds_config, placement),
        "",
        *_memory_lines(inputs, shape, world_size, lengths, gpu_memory_gib),
        f"dataset: {len(inputs.prompts)} prompts ({inputs.skipped_rows} bad rows skipped)",
    ]
    return "\n".join(lines)


def _layout_line(r: Recipe, ranks: str, dp: int) -> str:
    """The ranks as data x tensor x sequence parallel."""
    tp, sp = r.train.tensor_parallel_size, r.train.sequence_parallel_size
    return (
        f"parallel layout: {ranks} = data parallel {dp} "
        f"x tensor parallel {tp} x sequence parallel {sp}"
        + (
            f" (ranks {tp * sp}d .. {tp * sp}d+{tp * sp - 1} form group d and run the same samples)"
            if tp * sp > 1
            else ""
        )
    )


def _batch_algebra_lines(r: Recipe) -> list[str]:
    """Samples per step and per optimizer step, the micro-batches, and which log-prob passes run."""
    t = r.train
    layout = (
        "one padded row each (sequence parallelism: no packing)"
        if t.sequence_parallel_size > 1
        else "packed into rows"
        if t.packing
        else "one padded row each"
    )
    cap = f"<= {t.max_tokens_per_micro_batch} {'real' if t.packing else 'padded'} tokens (dynamic)"
    micro_rule = cap if t.max_tokens_per_micro_batch else f"{t.micro_batch_samples_per_gpu} samples"
    lp_rule = (
        cap if t.max_tokens_per_micro_batch else f"{t.logprob_micro_batch_samples_per_gpu} samples"
    )
    return [
        "batch algebra",
        f"  samples per step             {r.samples_per_step} = prompts_per_step "
        f"{r.rollout.prompts_per_step} x group_size {r.rollout.group_size}",
        f"  samples per optimizer step   {r.samples_per_optimizer_step}",
        f"  optimizer steps per rollout  {r.optimizer_steps_per_rollout} = {r.samples_per_step} / "
        f"{r.samples_per_optimizer_step} x epochs_per_rollout {t.epochs_per_rollout}",
        f"  update micro-batch           {micro_rule} per GPU, {layout}",
        f"  log-prob micro-batch         {lp_rule} per GPU",
        "  old-log-prob pass            "
        + (
            f"runs ({reason})"
            if (reason := old_logprob_pass_reason(r))
            else "skipped (one optimizer step per rollout: old = current)"
        ),
        "  reference log-prob pass      "
        + (
            f"runs (kl_coef {r.algorithm.kl_coef})"
            if r.algorithm.kl_coef > 0
            else "off (kl_coef 0)"
        ),
    ]


def _shard_lines(r: Recipe, plan: StepPlan, lengths: list[int], lengths_mode: str) -> list[str]:
    """Optimizer step 1's shard on each data-parallel rank: its samples, tokens and micro-batches;
    under sequence parallelism, what one of its ranks holds of the longest micro-batch."""
    tp, sp = r.train.tensor_parallel_size, r.train.sequence_parallel_size
    first = plan.minibatches[0]
    lines = [
        "per-rank shards of optimizer step 1 (simulated "
        f"lengths: {lengths_mode}; prompt lengths from the data"
        + ("; one line per data-parallel rank" if tp * sp > 1 else "")
        + (f"; tokens per rank: each sequence split in {sp}" if sp > 1 else "")
        + ")",
    ]
    for rank, micro in enumerate(first.micro_batches):
        ids = [s for mb in micro for s in mb]
        padding = sum(1 for mb in micro if not mb)
        lines.append(
            f"  rank {rank:>3}: {len(ids):>5} samples {sum(lengths[s] for s in ids):>8} tokens  "
            f"{len(micro)} update micro-batches ({padding} padding)  "
            f"{len(plan.logprob_pass.micro_batches[rank])} log-prob micro-batches"
        )
    # every micro-batch: sequence_parallel_rows rows, padded to a multiple of sp, split in sp
    if sp > 1:
        rows = r.sequence_parallel_rows
        widest = max(
            max(lengths[s] for s in mb)
            for m in plan.minibatches
            for rank in m.micro_batches
            for mb in rank
            if mb
        )
        lines.append(
            f"  per sequence-parallel rank: {rows} rows x {-(-widest // sp)} positions in the "
            f"longest micro-batch ({rows * -(-widest // sp)} "
            f"model positions, of {rows * widest} unsplit)"
        )
    lines.append(f"  token imbalance (max/mean over ranks): {token_imbalance(first, lengths):.3f}")
    return lines


def _deepspeed_lines(r: Recipe, ds: dict, ranks: str, dp: int) -> list[str]:
    """The resolved DeepSpeed config's batch keys and ZeRO stage, and the file it came from."""
    _, ds_where = load_deepspeed_json(r)
    return [
        f"DeepSpeed (resolved from {ds_where})",
        f"  train_micro_batch_size_per_gpu  {ds['train_micro_batch_size_per_gpu']}",
        f"  gradient_accumulation_steps     {ds['gradient_accumulation_steps']} (static plan; "
        "grpo_ds owns the step boundary, so padding and dynamic batches need no change here)",
        f"  train_batch_size                {ds['train_batch_size']} = "
        f"{ds['train_micro_batch_size_per_gpu']} x {ds['gradient_accumulation_steps']} x "
        + (f"data-parallel size {dp}" if r.train.sequence_parallel_size > 1 else ranks)
        if "train_batch_size" in ds
        else "  train_batch_size                left out (AutoTP "
        "under ZeRO-3: DeepSpeed checks it against two sizes)",
        f"  zero stage                      {zero_stage(ds)}"
        + (f" ({stage_note})" if (stage_note := one_rank_stage_note(r, ds)) else ""),
    ]


def _kernels_line(inputs: Inputs, vocab: int) -> str:
    """The kernels backend, whether full logits exist, and the log-prob chunk."""
    r = inputs.recipe
    return (
        f"kernels: {inputs.kernels_backend} backend (kernels.backend {r.kernels.backend!r}), "
        + (
            "full logits, "
            if not r.kernels.fused_lm_head
            else "fused lm_head (no full logits), "
            if r.train.tensor_parallel_size == 1
            else "full logits (tensor parallelism splits the lm_head), "
        )
        + _chunk_text(r, inputs.kernels_backend, vocab)
    )


def _memory_lines(
    inputs: Inputs,
    shape: memory.ModelShape,
    world_size: int,
    lengths: list[int],
    gpu_memory_gib: float | None,
) -> list[str]:
    """The memory estimate of a rank that trains, term by term (grpo_ds.step.memory_fit), whether
    it fits the GPU, a rollout rank's (split placement) and the reward models' shares."""
    r, placement = inputs.recipe, inputs.placement
    reward_models = tuple(memory.reward_model_shape(spec) for spec in inputs.reward_models)
    est = estimate_memory(
        r,
        shape,
        inputs.ds_config,
        world_size,
        lengths,
        gpu_memory_gib,
        inputs.kernels_backend,
        placement,
        reward_models,
    )
    lines = [
        f"memory estimate per {'trainer ' if placement.split else ''}rank "
        f"({shape.params / 1e6:.2f} M parameters{_trained_text(r, shape)}, {r.model.dtype}; "
        "grpo_ds/model/memory.py says how each line is counted)",
    ]
    lines += [f"  {name:<52} {value / GIB:8.3f} GiB" for name, value in est.device.items()]
    lines += [
        f"  {name + ' (offloaded to host)':<52} {value / GIB:8.3f} GiB"
        for name, value in est.host.items()
    ]
    lines += [f"  + {name:<50} {value / GIB:8.3f} GiB" for name, value in est.phases.items()]
    lines.append(f"  {'peak on the device (the larger phase)':<52} {est.peak / GIB:8.3f} GiB")
    if est.host:
        lines.append(f"  {'host memory (offload)':<52} {sum(est.host.values()) / GIB:8.3f} GiB")
    if gpu_memory_gib is not None:
        lines += fit_lines(inputs, lengths, est, gpu_memory_gib, reward_models)
    if placement.split:
        lines.append(_rollout_rank_line(r, shape, placement, lengths, gpu_memory_gib))
    return lines + _reward_model_lines(inputs, reward_models, est)


def _trained_text(r: Recipe, shape: memory.ModelShape) -> str:
    """What of the parameters trains (LoRA), and how a mixture of experts counts them."""
    trained = (
        f", {shape.trainable / 1e6:.2f} M trainable (LoRA rank {r.model.lora_rank})"
        if lora.enabled(r.model)
        else ""
    )
    # every expert's parameters are counted; a token uses k of them in each MoE layer
    if shape.moe_layers:
        trained += (
            f", a mixture of experts: {shape.experts} in each of {shape.moe_layers} layers, "
            f"{shape.experts_per_token} per token"
        )
    return trained


def _reward_model_lines(
    inputs: Inputs, shapes: tuple[memory.RewardModelShape, ...], est: memory.MemoryEstimate
) -> list[str]:
    """One line per reward model: its name, folder, parameters, dtype and its share of the memory
    estimate."""
    if not shapes:
        return []
    dtype = memory.reward_model_dtype(inputs.recipe)
    lines = [
        f"reward models (on every {'trainer ' if inputs.placement.split else ''}rank, like the "
        "reference model: model.dtype, partitioned under ZeRO-3, no optimizer)"
    ]
    for spec, rm in zip(inputs.reward_models, shapes, strict=True):
        line = memory.reward_model_line(rm.name)
        where = (
            f"{est.host[line] / 2**20:.2f} MiB per rank in host memory (offload; on the device "
            "only while it scores)"
            if rm.offload
            else f"{est.device[line] / 2**20:.2f} MiB per rank, "
            f"{100 * est.device[line] / est.peak:.1f}% of the peak"
        )
        lines.append(f"  {rm.name}: {spec.path}, {rm.params:,} parameters, {dtype}, {where}")
    return lines


def _rollout_line(r: Recipe, ds: dict, placement: Placement) -> str:
    """Where generation runs and how its weights come."""
    if placement.split:
        k = placement.rollout_ranks
        where = (
            f"rollout: {r.rollout.engine} engine on the {k} rollout rank{'s' if k > 1 else ''}, "
        )
        if r.uses_vllm:
            tp = r.rollout.vllm_tensor_parallel_size
            return where + (
                f"{k // tp} vLLM engine{'s' if k // tp > 1 else ''} of tensor parallel {tp}, their "
                "own weights from model.path, updated from the trainer over the bridge "
                f"(grpo_ds.distributed.bridge) after every optimizer step{_vllm_sync()}"
            )
        return where + (
            f"{'each ' if k > 1 else ''}with a plain copy of the policy, updated from the trainer "
            "over the bridge (grpo_ds.distributed.bridge) after every optimizer step"
        )
    return f"rollout: {r.rollout.engine} engine, " + (
        "generating with the policy's own module (every "
        "rank holds it whole: no copy, no weight sync)"
        if rollout_shares_policy(r, ds)
        else f"its own weights from model.path, synced after every optimizer step{_vllm_sync()}"
        if r.uses_vllm
        else "generating with an unsharded copy of the policy, synced after every optimizer step"
    )


def _rollout_rank_line(
    r: Recipe,
    shape: memory.ModelShape,
    placement: Placement,
    lengths: list[int],
    gpu_memory_gib: float | None,
) -> str:
    """Split placement: one line for a rollout rank's memory (grpo_ds.model.memory.rollout_rank)."""
    sequences = (
        prompts_per_generate_call(r, placement.rollout_ranks, rollout_side=True)
        * r.rollout.group_size
    )
    parts = memory.rollout_rank(
        r,
        shape,
        max(lengths),
        sequences,
        gpu_memory_gib,
        static_cache(r, placement.rollout_ranks, max(lengths), gpu_memory_gib, True),
    )
    if parts is None:
        return (
            f"memory of a rollout rank: vLLM's share, rollout.vllm_gpu_memory_utilization "
            f"{r.rollout.vllm_gpu_memory_utilization:g} of its GPU (--gpu-memory-gib sizes it)"
        )
    text = " + ".join(f"{name} {value / GIB:.3f} GiB" for name, value in parts.items())
    total = f" = {sum(parts.values()) / GIB:.3f} GiB" if len(parts) > 1 else ""
    return f"memory of a rollout rank: {text}{total}"


def _vllm_sync() -> str:
    """How the installed vLLM would take the weights ("" when none is installed here: the run's
    machine decides)."""
    from grpo_ds.config.software import installed_versions

    version = installed_versions()["vllm"]
    if version is None:
        return " (no vLLM installed here: the weight-sync path is chosen where the run starts)"
    from grpo_ds.rollout.vllm_checks import weight_sync_path

    return f" through {weight_sync_path()} (vLLM {version} installed here)"


def _chunk_text(r: Recipe, backend: str, vocab: int) -> str:
    k = r.kernels
    if k.logprob_chunk_tokens is not None:
        return f"{k.logprob_chunk_tokens} tokens per chunk (kernels.logprob_chunk_tokens)"
    dtype = getattr(torch, r.model.dtype)
    tokens = chunk_tokens_for(vocab, dtype, backend, int(k.logprob_chunk_mib * 2**20))
    per_token = chunk_bytes_per_token(vocab, dtype, backend)
    return (
        f"{tokens:,} tokens per chunk ({tokens * per_token / 2**20:.1f} MiB of a "
        f"{k.logprob_chunk_mib:g} MiB budget, "
        f"kernels.logprob_chunk_mib, at {vocab:,} vocabulary entries)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="grpo_ds.check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="path to a recipe JSON file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument(
        "--world-size", type=int, default=1, help="number of ranks (GPUs) to plan for"
    )
    parser.add_argument(
        "--lengths",
        choices=("uniform", "max"),
        default="uniform",
        help="completion lengths to simulate: uniform in "
        "[1, max_new_tokens], or all at the maximum",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory of one GPU: say whether the estimate fits and what would make it fit "
        "(default: the visible GPU's, if there is one)",
    )
    args = parser.parse_intermixed_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0:
        parser.error("--gpu-memory-gib must be > 0")
    gpu = args.gpu_memory_gib
    if gpu is None and device_type() == "cuda":
        import torch

        gpu = torch.cuda.get_device_properties(0).total_memory / GIB
    with exit_on_user_error():
        inputs = prepare_inputs(
            args.recipe, args.overrides, args.world_size, device_type(), machine=False
        )
        # bad input: stdout empty
        print("\n".join(environment_lines(software.survey(), device_type())) + "\n")
        print(report(inputs, args.world_size, args.lengths, gpu))
        if inputs.recipe.uses_vllm:
            print(
                "note: vLLM: the installed version (and on a CPU its attention's head sizes) is "
                "checked when the run starts, on the machine it runs on"
            )


if __name__ == "__main__":
    main()
