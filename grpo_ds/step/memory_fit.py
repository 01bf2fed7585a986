"""A rank's memory for the recipe's first planned step, and the overrides that would make it fit a
GPU: the dry run's estimate and advice (grpo_ds.check prints them).

``estimate_memory`` plans the step over simulated lengths (grpo_ds.step.plan) and counts its
largest micro-batch, generate call and compiled-decode caches with grpo_ds.model.memory's terms.
``fit_lines`` says whether the peak fits a GPU; if not, it tries the changes of ``_changes`` in the
Ultra-Scale Playbook's order (activation checkpointing, smaller micro-batches, then offload and
tensor parallelism), with grpo_ds's own between them (eager decoding, smaller generate calls).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.placement import Placement
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import device_type
from grpo_ds.errors import UserError
from grpo_ds.model import lora, memory
from grpo_ds.model.memory import GIB
from grpo_ds.rollout.hf_compile import cache_length, compile_wanted
from grpo_ds.step.plan import plan_recipe_step

if TYPE_CHECKING:
    from grpo_ds.run.preflight import Inputs


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
    generation = prompts_per_generate_call(r, world_size) * r.rollout.group_size
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
        static_cache=static_cache(r, world_size, max(lengths), gpu_memory_gib),
    )


def static_cache(
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


def _prompts_per_rank(r: Recipe, world_size: int, rollout_side: bool = False) -> int:
    """A rank's share of the step's prompts: over the data-parallel ranks, or a split placement's
    rollout ranks (``rollout_side``), which each take a share."""
    dp = world_size if rollout_side else world_size // r.train.tensor_parallel_size
    return -(-r.rollout.prompts_per_step // dp)


def prompts_per_generate_call(r: Recipe, world_size: int, rollout_side: bool = False) -> int:
    """Prompts in a rank's largest generate call: its share of the step's prompts
    (``_prompts_per_rank``), at most rollout.generation_batch_prompts."""
    return min(r.rollout.generation_batch_prompts, _prompts_per_rank(r, world_size, rollout_side))


# knob -> (its override as the user writes it, the function that applies it to a recipe)
Changes = dict[str, tuple[str, Callable[[Recipe], Recipe]]]


def fit_lines(
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
    limit = gpu_memory_gib * GIB
    if est.peak <= limit:
        return [f"  fits in {gpu_memory_gib:g} GiB ({100 * est.peak / limit:.0f}% of it)"]
    peak = functools.partial(
        _peak,
        inputs=inputs,
        shape=memory.model_shape(inputs.recipe, len(inputs.tokenizer)),
        lengths=lengths,
        gpu_memory_gib=gpu_memory_gib,
        reward_models=reward_models,
    )
    lines = [
        f"  does NOT fit in {gpu_memory_gib:g} GiB; the "
        "changes tried, in order, each with the ones before:"
    ]
    changes: Changes = {}
    lowest, kept = est.peak, True
    # once a change has lowered the peak, a knob passed over before may lower it further: another
    # pass
    while kept:
        kept = False
        # every rank when colocated; split: the trainer's, DeepSpeed's world
        for knob, text, apply in _changes(inputs.recipe, inputs.placement.trainer_ranks):
            # a later value of a knob (the micro size) replaces the earlier
            trial = {**changes, knob: (text, apply)}
            value = peak(trial)
            # a layout that cannot run, or a change that saves nothing here
            if value is None or value >= lowest:
                continue
            changes, lowest, kept = trial, value, True
            fits = value <= limit
            lines.append(f"    {text:<90} {value / GIB:8.3f} GiB" + ("  fits" if fits else ""))
            if fits:
                changes = _without_needless(changes, knob, peak, limit)
                return lines + [
                    f"  overrides that fit: {' '.join(text for text, _ in changes.values())}"
                ]
    return lines + ["  nothing tried fits: more GPUs (a larger world size), or a smaller model"]


def _peak(
    changes: Changes,
    *,
    inputs: Inputs,
    shape: memory.ModelShape,
    lengths: list[int],
    gpu_memory_gib: float,
    reward_models: tuple[memory.RewardModelShape, ...],
) -> float | None:
    """The estimate's peak with these changes, None for a layout that cannot be."""
    r = inputs.recipe
    for _, apply in changes.values():
        r = apply(r)
    world_size = inputs.placement.trainer_ranks
    try:
        return estimate_memory(
            r,
            shape,
            resolve_deepspeed_config(r, world_size, device_type()),
            world_size,
            lengths,
            gpu_memory_gib,
            inputs.kernels_backend,
            inputs.placement,
            reward_models,
        ).peak
    except UserError:
        return None


def _without_needless(
    changes: Changes, last: str, peak: Callable[[Changes], float | None], limit: float
) -> Changes:
    """``changes`` without those the fit does not need, each tried away in turn (``last``, the knob
    that made it fit, is kept)."""
    for needless in [k for k in changes if k != last]:
        fewer = {k: v for k, v in changes.items() if k != needless}
        if (value := peak(fewer)) is not None and value <= limit:
            changes = fewer
    return changes


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
        prompts = prompts_per_generate_call(r, world_size)
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
