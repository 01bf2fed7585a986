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
import dataclasses

import numpy as np
import torch

from grpo_ds.config import software
from grpo_ds.config.deepspeed import (
    load_deepspeed_json,
    one_rank_stage_note,
    resolve_deepspeed_config,
    rollout_shares_policy,
)
from grpo_ds.config.deepspeed_keys import zero_stage
from grpo_ds.config.placement import Placement
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import device_type
from grpo_ds.errors import UserError, exit_on_user_error
from grpo_ds.kernels import chunk_bytes_per_token, chunk_tokens_for
from grpo_ds.model import lora, memory
from grpo_ds.model.memory import GIB
from grpo_ds.rollout.hf_compile import cache_length, compile_wanted
from grpo_ds.run.preflight import Inputs, prepare_inputs
from grpo_ds.step.plan import old_logprob_pass_reason, plan_recipe_step, token_imbalance


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
    r = inputs.recipe
    lengths = simulated_lengths(inputs, lengths_mode)
    t = r.train
    tp, sp = t.tensor_parallel_size, t.sequence_parallel_size
    placement = inputs.placement
    # the world the batch algebra and DeepSpeed see (all ranks when colocated)
    trainers = placement.trainer_ranks
    ranks = f"trainer ranks {trainers}" if placement.split else f"world size {world_size}"
    dp = trainers // tp // sp
    plan = plan_recipe_step(r, lengths, dp, step=1)
    ds = inputs.ds_config
    _, ds_where = load_deepspeed_json(r)
    first = plan.minibatches[0]
    layout = (
        "one padded row each (sequence parallelism: no packing)"
        if sp > 1
        else "packed into rows"
        if t.packing
        else "one padded row each"
    )
    cap = f"<= {t.max_tokens_per_micro_batch} {'real' if t.packing else 'padded'} tokens (dynamic)"
    micro_rule = cap if t.max_tokens_per_micro_batch else f"{t.micro_batch_samples_per_gpu} samples"
    lp_rule = (
        cap if t.max_tokens_per_micro_batch else f"{t.logprob_micro_batch_samples_per_gpu} samples"
    )
    lines = [
        f"recipe is valid for world size {world_size}",
        f"placement: {placement.describe()}",
        f"parallel layout: {ranks} = data parallel {dp} "
        f"x tensor parallel {tp} x sequence parallel {sp}"
        + (
            f" (ranks {tp * sp}d .. {tp * sp}d+{tp * sp - 1} form group d and run the same samples)"
            if tp * sp > 1
            else ""
        ),
        "",
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
        "",
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
    shape = memory.model_shape(r, len(inputs.tokenizer))
    lines += [
        f"  token imbalance (max/mean over ranks): {token_imbalance(first, lengths):.3f}",
        "",
        f"DeepSpeed (resolved from {ds_where})",
        f"  train_micro_batch_size_per_gpu  {ds['train_micro_batch_size_per_gpu']}",
        f"  gradient_accumulation_steps     {ds['gradient_accumulation_steps']} (static plan; "
        "grpo_ds owns the step boundary, so padding and dynamic batches need no change here)",
        f"  train_batch_size                {ds['train_batch_size']} = "
        f"{ds['train_micro_batch_size_per_gpu']} x {ds['gradient_accumulation_steps']} x "
        + (f"data-parallel size {dp}" if sp > 1 else ranks)
        if "train_batch_size" in ds
        else "  train_batch_size                left out (AutoTP "
        "under ZeRO-3: DeepSpeed checks it against two sizes)",
        f"  zero stage                      {zero_stage(ds)}"
        + (f" ({stage_note})" if (stage_note := one_rank_stage_note(r, ds)) else ""),
        "",
        f"kernels: {inputs.kernels_backend} backend (kernels.backend {r.kernels.backend!r}), "
        + (
            "full logits, "
            if not r.kernels.fused_lm_head
            else "fused lm_head (no full logits), "
            if tp == 1
            else "full logits (tensor parallelism splits the lm_head), "
        )
        + _chunk_text(r, inputs.kernels_backend, shape.vocab),
        _rollout_line(r, ds, placement),
    ]
    reward_models = tuple(memory.reward_model_shape(spec) for spec in inputs.reward_models)
    est = estimate_memory(
        r,
        shape,
        ds,
        world_size,
        lengths,
        gpu_memory_gib,
        inputs.kernels_backend,
        placement,
        reward_models,
    )
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
    lines += [
        "",
        f"memory estimate per {'trainer ' if placement.split else ''}rank "
        f"({shape.params / 1e6:.2f} M parameters{trained}, {r.model.dtype}; "
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
        lines += _fit(inputs, lengths, est, gpu_memory_gib, reward_models)
    if placement.split:
        lines.append(_rollout_rank_line(r, shape, placement, lengths, gpu_memory_gib))
    lines += _reward_model_lines(inputs, reward_models, est)
    lines.append(f"dataset: {len(inputs.prompts)} prompts ({inputs.skipped_rows} bad rows skipped)")
    return "\n".join(lines)


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
        _prompts_per_generate_call(r, placement.rollout_ranks, rollout_side=True)
        * r.rollout.group_size
    )
    parts = memory.rollout_rank(
        r,
        shape,
        max(lengths),
        sequences,
        gpu_memory_gib,
        _static_cache(r, placement.rollout_ranks, max(lengths), gpu_memory_gib, True),
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


def estimate_memory(
    r: Recipe,
    shape: memory.ModelShape,
    ds_config: dict,
    world_size: int,
    lengths: list[int],
    gpu_memory_gib: float | None = None,
    backend: str = "torch",
    placement: Placement | None = None,
    reward_models: tuple[memory.RewardModelShape, ...] = (),
) -> memory.MemoryEstimate:
    """The estimate of a rank that trains, for the recipe's first planned step over ``lengths``;
    ``backend``: the resolved kernels backend; ``placement``: split counts the trainer's ranks,
    which hold no rollout engine; ``reward_models``: the reward models every rank that trains
    holds."""
    split = placement is not None and placement.split
    if split:
        world_size = placement.trainer_ranks
    dp = world_size // r.train.tensor_parallel_size
    plan = plan_recipe_step(r, lengths, dp, step=1)
    micro = [mb for m in plan.minibatches for rank in m.micro_batches for mb in rank if mb]
    sp = r.train.sequence_parallel_size
    if sp > 1:  # padded rows, split along the positions
        model_tokens = r.sequence_parallel_rows * -(
            -max(max(lengths[s] for s in mb) for mb in micro) // sp
        )
    else:
        model_tokens = max(
            sum(lengths[s] for s in mb)
            if r.train.packing
            else len(mb) * max(lengths[s] for s in mb)
            for mb in micro
        )
    generation = _prompts_per_generate_call(r, world_size) * r.rollout.group_size
    return memory.estimate(
        r,
        shape,
        ds_config,
        world_size,
        model_tokens,
        max(lengths),
        generation,
        gpu_memory_gib,
        backend,
        rollout=not split,
        reward_models=reward_models,
        static_cache=_static_cache(r, world_size, max(lengths), gpu_memory_gib),
    )


def _static_cache(
    r: Recipe,
    world_size: int,
    longest: int,
    gpu_memory_gib: float | None,
    rollout_side: bool = False,
) -> tuple[int, int]:
    """(sequences, length) of the hf engine's compiled-decode caches (rollout.hf_compile; (0, 0)
    where it decodes eagerly): one cache per distinct generate-call size of a step (a smaller last
    call has its own), each as long as the widest prompt plus max_new_tokens (``longest``,
    completions at the limit), rounded up as the engine rounds. The estimate is for a GPU where
    --gpu-memory-gib (or the visible GPU) gives one, else for this CPU."""
    device = "cpu" if gpu_memory_gib is None else "cuda"
    if r.uses_vllm or r.rollout.engine != "hf" or not compile_wanted(r.rollout.hf_compile, device):
        return 0, 0
    share, per_call = (
        _prompts_per_rank(r, world_size, rollout_side),
        r.rollout.generation_batch_prompts,
    )
    prompts = min(share, per_call) + (share % per_call if share > per_call else 0)
    return prompts * r.rollout.group_size, cache_length(longest)


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


def _prompts_per_rank(r: Recipe, world_size: int, rollout_side: bool = False) -> int:
    """A rank's share of the step's prompts: over the data-parallel ranks, or a split placement's
    rollout ranks (``rollout_side``), which each take a share."""
    dp = world_size if rollout_side else world_size // r.train.tensor_parallel_size
    return -(-r.rollout.prompts_per_step // dp)


def _prompts_per_generate_call(r: Recipe, world_size: int, rollout_side: bool = False) -> int:
    """Prompts in a rank's largest generate call: its share of the step's prompts
    (``_prompts_per_rank``), at most rollout.generation_batch_prompts."""
    return min(r.rollout.generation_batch_prompts, _prompts_per_rank(r, world_size, rollout_side))


def _fit(
    inputs: Inputs,
    lengths: list[int],
    est: memory.MemoryEstimate,
    gpu_memory_gib: float,
    reward_models: tuple[memory.RewardModelShape, ...] = (),
) -> list[str]:
    """Whether the peak fits ``gpu_memory_gib``; if not, the changes that would make it fit, in this
    order: activation checkpointing and a smaller micro-batch with more accumulation (the
    Ultra-Scale Playbook's first), eager decoding in the hf engine (no static KV caches kept through
    the update: rollout.hf_compile=off), fewer prompts per generate call for the hf and agent
    engines, then the playbook's offload and tensor parallelism; each added to the ones before, with
    its estimate, up to the first that fits; a change that does not lower the estimate is not kept
    (a later pass tries it again), and the changes on the way that the fit does not need are dropped
    again."""
    if est.peak <= gpu_memory_gib * GIB:
        return [
            f"  fits in {gpu_memory_gib:g} GiB "
            f"({100 * est.peak / (gpu_memory_gib * GIB):.0f}% of it)"
        ]
    base, shape = inputs.recipe, memory.model_shape(inputs.recipe, len(inputs.tokenizer))
    placement = inputs.placement
    # every rank when colocated; split: the trainer's, DeepSpeed's world
    world_size = placement.trainer_ranks

    # the estimate with these changes, None for a layout that cannot be
    def peak(changes: dict) -> float | None:
        r = base
        for _, apply in changes.values():
            r = apply(r)
        try:
            return estimate_memory(
                r,
                shape,
                resolve_deepspeed_config(r, world_size, device_type()),
                world_size,
                lengths,
                gpu_memory_gib,
                inputs.kernels_backend,
                placement,
                reward_models,
            ).peak
        except UserError:
            return None

    lines = [
        f"  does NOT fit in {gpu_memory_gib:g} GiB; the "
        "changes tried, in order, each with the ones before:"
    ]
    changes: dict = {}
    lowest, kept = est.peak, True
    # once a change has lowered the peak, a knob passed over before may lower it further: another
    # pass
    while kept:
        kept = False
        for knob, text, apply in _changes(base, world_size):
            # a later value of a knob (the micro size) replaces the earlier
            trial = {**changes, knob: (text, apply)}
            value = peak(trial)
            # a layout that cannot run, or a change that saves nothing here
            if value is None or value >= lowest:
                continue
            changes, lowest, kept = trial, value, True
            fits = value <= gpu_memory_gib * GIB
            lines.append(f"    {text:<90} {value / GIB:8.3f} GiB" + ("  fits" if fits else ""))
            if fits:
                # drop what the fit does not need
                for needless in [k for k in changes if k != knob]:
                    fewer = {k: v for k, v in changes.items() if k != needless}
                    if (value := peak(fewer)) is not None and value <= gpu_memory_gib * GIB:
                        changes = fewer
                return lines + [
                    f"  overrides that fit: {' '.join(text for text, _ in changes.values())}"
                ]
    return lines + ["  nothing tried fits: more GPUs (a larger world size), or a smaller model"]


def _changes(r: Recipe, world_size: int):
    """(knob, override, function applying it to a recipe) in the playbook's order; later ones of a
    knob go further."""

    def replace(section: str, **values):
        return lambda recipe: dataclasses.replace(
            recipe, **{section: dataclasses.replace(getattr(recipe, section), **values)}
        )

    if not r.model.gradient_checkpointing:
        yield (
            "checkpointing",
            "model.gradient_checkpointing=true",
            replace("model", gradient_checkpointing=True),
        )
    micro = r.train.micro_batch_samples_per_gpu
    while micro > 1:
        micro //= 2
        yield (
            "micro",
            f"train.micro_batch_samples_per_gpu={micro} "
            f"train.logprob_micro_batch_samples_per_gpu={micro}",
            replace(
                "train",
                micro_batch_samples_per_gpu=micro,
                logprob_micro_batch_samples_per_gpu=micro,
            ),
        )
    # the static KV caches, held through the update; eager decoding costs about what one halving of
    # the generate call below does (a decode step is launch-bound, so half the rows take about as
    # long), and frees them all
    if r.rollout.engine == "hf" and r.rollout.hf_compile != "off":
        yield "compile", "rollout.hf_compile=off", replace("rollout", hf_compile="off")
    if r.rollout.engine in ("hf", "agent"):  # the KV cache of one generate call; vLLM sizes its own
        prompts = _prompts_per_generate_call(r, world_size)
        while prompts > 1:
            prompts //= 2
            yield (
                "generation",
                f"rollout.generation_batch_prompts={prompts}",
                replace("rollout", generation_batch_prompts=prompts),
            )
    offload = [
        "ds_configs/zero3.json",
        "ds_configs/zero3_offload_optimizer.json",
        "ds_configs/zero3_offload.json",
    ]
    for config in offload[offload.index(r.deepspeed) + 1 :] if r.deepspeed in offload else []:
        # the optimizer's states, then the weights too, to the CPU
        yield (
            "offload",
            f"deepspeed={config}",
            lambda recipe, c=config: dataclasses.replace(recipe, deepspeed=c),
        )
    tp = r.train.tensor_parallel_size
    while tp * 2 <= min(world_size, 8) and not lora.enabled(r.model):
        tp *= 2
        yield "tp", f"train.tensor_parallel_size={tp}", replace("train", tensor_parallel_size=tp)


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
