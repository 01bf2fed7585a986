"""Per-rank memory estimate of a recipe, before anything loads: model states, buffers and the
largest phase.

Everything is per rank, in bytes, for a model of P parameters (T of them trained; W bytes each in
model.dtype) split over dp data-parallel and tp tensor-parallel ranks. The model-state terms are
DeepSpeed's own allocations (deepspeed/runtime/zero/stage3.py: the low-precision parameter
partition, an fp32 master partition, a gradient partition in the parameters' dtype, and AdamW's two
fp32 moments), which measure at 20 bytes per trained parameter in float32 and 16 in bfloat16
(benchmarks/bench_memory_estimate.py). Lean bf16 mode (train.lean_bf16: DeepSpeed's
bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states, read from the resolved config)
keeps the master and the moments in bf16, M = 2 bytes instead of 4: 10 bytes per trained parameter
under ZeRO-3, 8 at one rank.

    policy weights     P x W / shard            ZeRO-3: shard = dp x tp; ZeRO 0-2: tp (the TP-split
                       part)
    master weights     T x M / opt shard        opt shard = dp x tp from ZeRO-1 on; none where the
                                                weights are as wide as the master and the rank's
                                                partition is the whole model (ZeRO 0, or one
                                                data-parallel rank:
                                                grpo_ds.model.engine.share_fp32_master)
    gradients          T x W / grad shard       grad shard = dp x tp from ZeRO-2 on
    Adam moments       T x 2M / opt shard
    reference model    P x W / shard            only with algorithm.kl_coef > 0 and full fine-tuning
    reward model       R x W / shard            each of reward.models (R of its parameters, from its
                                                config.json on the meta device:
                                                ``reward_model_shape``), loaded like the reference
                                                (model.dtype, no optimizer, no gradients); its
                                                ``offload``: in host memory, and back on the device
                                                only in the scoring phase below (all of them at
                                                once: an upper bound)
    rollout copy       P x W                    the hf and agent engines' unsharded copy (none where
                                                they generate with the policy's own module:
                                                grpo_ds.config.deepspeed.rollout_shares_policy)
    vLLM               gpu_memory_utilization x the GPU's memory (--gpu-memory-gib); with sleep mode
                       only while it generates, its weights in host memory (P x W / vllm tp)
                       otherwise
    static KV caches   S x L x layers x 2 x kv x head_dim x W: rollout.hf_compile's caches
                       (grpo_ds.rollout.hf_compile), kept between steps so that the CUDA graphs
                       keep their addresses: S sequences over the distinct generate-call sizes of a
                       step, L = prompt width + max_new_tokens rounded up as the engine rounds it
                       (hf_compile.cache_length); the generation phase then holds no KV cache of its
                       own
    reduce bucket      reduce_bucket_size x W   DeepSpeed's gradient bucket (capped at the trained
                                                parameters); ZeRO-3 keeps it from the first backward
                                                on, ZeRO 0-2 only during a backward
                                                (stage_1_and_2.py releases it at the backward's end,
                                                _release_ipg_buffers): there it counts in the update
                                                phase below

Under split placement (rollout.placement "split", grpo_ds.config.placement) a trainer rank holds no
rollout engine: no rollout copy, no vLLM share and no generation phase
(``estimate(..., rollout=False)``), and dp counts the trainer's ranks only. A rollout rank holds the
engine alone (``rollout_rank``): the hf and agent engines' plain copy (P x W, LoRA: the base, the
adapters merged in) plus the generation phase, or vLLM's share of its GPU.

Offload moves the master weights and the Adam moments (offload_optimizer), or the weights
(offload_param), to host memory: they are listed under ``host``. Then the largest phase on top:

    update          one micro-batch's activations (without activation checkpointing: every layer's
                    saved tensors, 8h + 3kv + 4i values a token, plus heads x T attention
                    probabilities; with it: one value of h a layer, plus one layer's worth; a
                    mixture-of-experts layer saves k(4i' + 3h) + 2E instead of 4i: each of the
                    token's k experts (intermediate size i') holds its gathered input, gate and up
                    projections, their product and its weighted output, and the router its logits
                    and probabilities over the E experts), the lm_head's logits (the fused head: two
                    fp32 chunks of chunk x vocab; full logits: the logits and their gradient) and,
                    under ZeRO-3, the gathered parameters (the prefetch bucket plus the largest
                    layer, capped at the rank's parameters) and one layer's full gradient:
                    DeepSpeed's gradient hook copies each parameter's gradient into the reduce
                    bucket (counted above; at ZeRO 0-2 here) as soon as it is computed
    optimizer step  temporaries of the master's width (M) the size of the trained partition with
                    torch's AdamW (DeepSpeed's torch_adam, on the CPU): from ZeRO-1 on, the flat
                    gradient partition DeepSpeed builds in the master's dtype while the gradients
                    are still held, and with bf16/fp16 weights at ZeRO 1-2 a second one (an
                    empirical rule from whole one-rank runs, RSS: the estimate is off the measured
                    peak by +7% at 56 M bf16 parameters with the fp32 master, and by -3% at 17 M and
                    56 M in lean bf16 mode; float32 weights hold one); two more (the square root and
                    the denominator) unless AdamW is fused, as grpo_ds.config.deepspeed makes it on
                    the CPU; DeepSpeed's fused and CPU Adam work in place (counted as 0)
    reward scoring  the weights of the offloaded reward models, back on the device (like the
                    reference's log-prob pass, the scoring forward's own activations are not
                    counted: no gradients are kept)
    generation      the KV cache of one generate call (layers x 2 x kv x head_dim values a position;
                    none of its own with rollout.hf_compile, whose static caches are counted above)
                    and two fp32 (batch x vocab) score tensors

The estimate is checked against measured peaks by benchmarks/bench_memory_estimate.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo_ds.config.deepspeed import rollout_shares_policy
from grpo_ds.config.deepspeed_keys import offloaded, zero_stage
from grpo_ds.config.dtypes import BYTES
from grpo_ds.config.recipe import Recipe
from grpo_ds.kernels import chunk_bytes_per_token, logprob_chunk_tokens
from grpo_ds.model import lora
from grpo_ds.model.engine import no_second_fp32_copy
from grpo_ds.model.shape import ModelShape, RewardModelShape
from grpo_ds.model.shape import model_shape as model_shape  # re-exported: grpo_ds.check reads
from grpo_ds.model.shape import reward_model_shape as reward_model_shape  # them from here

STATIC_CACHE_LINE = "static KV caches (rollout.hf_compile)"
GIB = 2**30
# DeepSpeed's defaults for the keys the estimate reads (deepspeed/runtime/zero/config.py)
_REDUCE_BUCKET, _PREFETCH_BUCKET, _MAX_LIVE = 500_000_000, 50_000_000, 1_000_000_000


@dataclass
class MemoryEstimate:
    # bytes per rank on the accelerator (CPU runs: RAM)
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)  # bytes per rank offloaded to host memory
    phases: dict[str, int] = field(default_factory=dict)  # the transient of each phase (device)

    @property
    def persistent(self) -> int:
        return sum(self.device.values())

    @property
    def peak(self) -> int:
        """Device bytes at the largest phase."""
        return self.persistent + max(self.phases.values(), default=0)

    @property
    def total(self) -> int:
        """Device and host together (what a CPU-only run holds in RAM)."""
        return self.peak + sum(self.host.values())


def reward_model_dtype(recipe: Recipe) -> str:
    """The dtype a reward model is loaded and counted in: the policy's, as the reference model's."""
    return recipe.model.dtype


def reward_model_line(name: str) -> str:
    """The estimate's line of one reward model (``device``, or ``host`` where it is offloaded)."""
    return f"reward model {name}"


def estimate(
    recipe: Recipe,
    shape: ModelShape,
    ds_config: dict,
    world_size: int,
    update_tokens: int,
    longest_sequence: int,
    generation_sequences: int,
    gpu_memory_gib: float | None = None,
    backend: str = "torch",
    rollout: bool = True,
    reward_models: tuple[RewardModelShape, ...] = (),
    static_cache: tuple[int, int] = (0, 0),
) -> MemoryEstimate:
    """Per-rank bytes. ``update_tokens``: the model's tokens (packed: the real ones; padded: samples
    x longest) of the largest update micro-batch;
    ``longest_sequence``: prompt + completion of its longest sample; ``generation_sequences``:
    sequences in one generate call (generation_batch_prompts x group_size); ``gpu_memory_gib`` sizes
    vLLM's share; ``backend``: the resolved kernels backend (it sizes the log-prob chunks);
    ``rollout``: whether the rank holds the rollout engine (False: a trainer rank of a split
    placement, whose ``world_size`` is the trainer's ranks); ``reward_models``: the shapes of
    reward.models, scored on every rank that trains; ``static_cache``: (sequences, length) of the hf
    engine's compiled-decode caches (rollout.hf_compile; (0, 0) where it decodes eagerly).

    The terms come in groups, each written by one function in the order the report lists them."""
    share = _Share.of(recipe, shape, ds_config, world_size)
    est = MemoryEstimate()
    _model_states(est, recipe, share)
    _reward_models(est, recipe, share, reward_models)
    if rollout:
        _rollout_engine(est, recipe, shape, ds_config, share.w, gpu_memory_gib, static_cache)
    _update_phase(est, recipe, shape, share, update_tokens, longest_sequence, backend)
    _optimizer_step_phase(est, ds_config, share)
    if rollout:
        _generation_phase(
            est,
            recipe,
            shape,
            share.w,
            longest_sequence,
            generation_sequences,
            gpu_memory_gib,
            static_cache,
        )
    return est


@dataclass(frozen=True)
class _Share:
    """How one rank holds the model under the resolved DeepSpeed config: read once by
    ``estimate``, for each of its groups of terms."""

    w: int  # bytes of one weight (model.dtype)
    m: int  # bytes of one master weight and of one Adam moment (``master_width``)
    master: str  # the master's dtype name
    zero: dict  # the config's zero_optimization section
    stage: int
    tp: int
    dp: int
    offload_opt: bool
    offload_param: bool
    per_rank: float  # parameters a rank's layers hold
    trained: float  # the trained ones among them (LoRA: the adapters' share)

    @classmethod
    def of(cls, recipe: Recipe, shape: ModelShape, ds_config: dict, world_size: int) -> _Share:
        zero, tp = ds_config.get("zero_optimization") or {}, recipe.train.tensor_parallel_size
        # embeddings, norms, the lm_head: whole on every TP rank
        per_rank = shape.split / tp + (shape.params - shape.split)
        m, master = master_width(ds_config)
        return cls(
            w=BYTES[recipe.model.dtype],
            m=m,
            master=master,
            zero=zero,
            stage=zero_stage(ds_config),
            tp=tp,
            dp=world_size // tp,
            offload_opt=offloaded(zero, "offload_optimizer"),
            offload_param=offloaded(zero, "offload_param"),
            per_rank=per_rank,
            # LoRA: the adapters' share of every rank's parameters
            trained=per_rank * (shape.trainable / shape.params),
        )

    def shard(self, from_stage: int) -> int:
        """The ranks a state is split over: dp from ZeRO stage ``from_stage`` on (3: the weights,
        2: the gradients, 1: the master weights and the moments), else none."""
        return self.dp if self.stage >= from_stage else 1


def _model_states(est: MemoryEstimate, recipe: Recipe, s: _Share) -> None:
    """The policy's weights, master weights, Adam moments and gradients; the reference model."""
    weights = est.host if s.offload_param else est.device
    weights["policy weights"] = _b(s.per_rank * s.w / s.shard(3))
    states = est.host if s.offload_opt else est.device
    if no_second_fp32_copy(s.w, s.stage, s.dp, s.offload_opt, s.m):
        kind = "float32" if s.m == 4 else "bf16"
        states[f"master weights ({s.master}): the {kind} weights themselves"] = 0
    else:
        states[f"master weights ({s.master})"] = _b(s.trained * s.m / s.shard(1))
    states[f"Adam moments ({s.master} m, v)"] = _b(s.trained * 2 * s.m / s.shard(1))
    est.device["gradients"] = _b(s.trained * s.w / s.shard(2))
    if recipe.algorithm.kl_coef > 0 and not lora.enabled(recipe.model):
        est.device["reference model"] = _b(s.per_rank * s.w / s.shard(3))


def _reward_models(
    est: MemoryEstimate, recipe: Recipe, s: _Share, reward_models: tuple[RewardModelShape, ...]
) -> None:
    """Each reward model's weights, and the offloaded ones back on the device while they score."""
    scoring = 0
    rm_width = BYTES[reward_model_dtype(recipe)]
    for rm in reward_models:  # partitioned like the reference model under ZeRO-3, whole otherwise
        weights = _b(rm.params * rm_width / s.shard(3))
        (est.host if rm.offload else est.device)[reward_model_line(rm.name)] = weights
        scoring += weights if rm.offload else 0
    if scoring:
        est.phases["reward scoring (offloaded weights on the device)"] = scoring


def _rollout_engine(
    est: MemoryEstimate,
    recipe: Recipe,
    shape: ModelShape,
    ds_config: dict,
    w: int,
    gpu_memory_gib: float | None,
    static_cache: tuple[int, int],
) -> None:
    """What the rollout engine keeps between steps on a rank that holds it: vLLM's share (asleep:
    its weights in host memory), or the hf and agent engines' copy; the static KV caches."""
    r = recipe.rollout
    if recipe.uses_vllm and r.vllm_sleep_mode:  # asleep (weights in host memory) but to generate
        est.host["vLLM weights while asleep"] = _b(shape.params * w / r.vllm_tensor_parallel_size)
    elif recipe.uses_vllm:
        est.device["vLLM (gpu_memory_utilization)"] = _vllm_share(recipe, gpu_memory_gib)
    elif not rollout_shares_policy(recipe, ds_config):
        est.device["rollout copy (unsharded)"] = _rollout_copy(recipe, shape, w)
    if static_cache[0]:
        est.device[STATIC_CACHE_LINE] = _kv_cache(shape, w, *static_cache)


def _update_phase(
    est: MemoryEstimate,
    recipe: Recipe,
    shape: ModelShape,
    s: _Share,
    update_tokens: int,
    longest_sequence: int,
    backend: str,
) -> None:
    """The reduce bucket (kept under ZeRO-3), and the update micro-batch's transient: activations,
    logits and, under ZeRO-3, the gathered parameters (at ZeRO 0-2, the bucket)."""
    bucket = _b(min(s.zero.get("reduce_bucket_size", _REDUCE_BUCKET), s.trained) * s.w)
    update = _update_bytes(recipe, shape, s.w, s.tp, update_tokens, longest_sequence, backend)
    if s.stage == 3:
        # ZeRO-3 keeps it; ZeRO 0-2 only during a backward (the update phase)
        est.device["reduce bucket"] = bucket
        prefetch = s.zero.get("stage3_prefetch_bucket_size", _PREFETCH_BUCKET)
        live = s.zero.get("stage3_max_live_parameters", _MAX_LIVE)
        gathered = (
            min(prefetch + shape.largest_layer, live, s.per_rank)
            + min(shape.largest_layer, s.per_rank)
        ) * s.w
        est.phases["update micro-batch (activations, logits, gathers)"] = update + _b(gathered)
    else:
        est.phases["update micro-batch (activations, logits, reduce bucket)"] = update + bucket


def _optimizer_step_phase(est: MemoryEstimate, ds_config: dict, s: _Share) -> None:
    """torch's AdamW's temporaries of the master's width; DeepSpeed's fused and CPU Adam: none."""
    adam = (ds_config.get("optimizer") or {}).get("params") or {}
    torch_adam = bool(adam.get("torch_adam")) and not s.offload_opt
    temporaries = (0 if s.stage == 0 else 2 if s.w < 4 and s.stage < 3 else 1) + (
        0 if adam.get("fused") else 2
    )
    est.phases[
        f"optimizer step ({s.master} temporaries)" if torch_adam else "optimizer step (in place)"
    ] = _b(temporaries * s.trained * s.m / s.shard(1)) if torch_adam else 0


def _generation_phase(
    est: MemoryEstimate,
    recipe: Recipe,
    shape: ModelShape,
    w: int,
    longest_sequence: int,
    generation_sequences: int,
    gpu_memory_gib: float | None,
    static_cache: tuple[int, int],
) -> None:
    """One generate call on a rank that holds the rollout engine: vLLM awake (with sleep mode), or
    the hf and agent engines' KV cache (none of its own with the static caches) and scores."""
    if recipe.uses_vllm:
        if recipe.rollout.vllm_sleep_mode:
            est.phases["generation (vLLM awake: gpu_memory_utilization)"] = _vllm_share(
                recipe, gpu_memory_gib
            )
    elif static_cache[0]:
        est.phases["generation (scores; the KV cache is the static one)"] = _scores(
            shape, generation_sequences
        )
    else:
        est.phases["generation (KV cache, scores)"] = _generation(
            shape, w, longest_sequence, generation_sequences
        )


def _vllm_share(recipe: Recipe, gpu_memory_gib: float | None) -> int:
    """vLLM's share of the GPU (rollout.vllm_gpu_memory_utilization); 0 when the GPU is not
    known."""
    return _b(recipe.rollout.vllm_gpu_memory_utilization * (gpu_memory_gib or 0) * GIB)


def rollout_rank(
    recipe: Recipe,
    shape: ModelShape,
    longest_sequence: int,
    generation_sequences: int,
    gpu_memory_gib: float | None = None,
    static_cache: tuple[int, int] = (0, 0),
) -> dict[str, int] | None:
    """A split placement's rollout rank, in bytes by part: the hf and agent engines' plain copy and
    one generate call of ``generation_sequences`` sequences (with ``static_cache``, as in
    ``estimate``: those caches and the scores); vLLM: its share of the GPU (None when the GPU's
    memory is not known)."""
    w = BYTES[recipe.model.dtype]
    if recipe.uses_vllm:
        if gpu_memory_gib is None:
            return None
        return {"vLLM (gpu_memory_utilization)": _vllm_share(recipe, gpu_memory_gib)}
    parts = {"copy of the weights": _rollout_copy(recipe, shape, w)}
    if static_cache[0]:
        parts |= {
            STATIC_CACHE_LINE: _kv_cache(shape, w, *static_cache),
            "generation scores": _scores(shape, generation_sequences),
        }
    else:
        parts["generation (KV cache, scores)"] = _generation(
            shape, w, longest_sequence, generation_sequences
        )
    return parts


def _rollout_copy(recipe: Recipe, shape: ModelShape, w: int) -> int:
    """The unsharded copy the hf and agent engines generate with (LoRA: the base, the adapters
    merged in)."""
    return _b((shape.params - (shape.trainable if lora.enabled(recipe.model) else 0)) * w)


def _generation(shape: ModelShape, w: int, longest_sequence: int, sequences: int) -> int:
    """One generate call's KV cache and two fp32 (batch x vocab) score tensors."""
    return _kv_cache(shape, w, sequences, longest_sequence) + _scores(shape, sequences)


def _kv_cache(shape: ModelShape, w: int, sequences: int, positions: int) -> int:
    return _b(
        sequences
        * positions
        * shape.layers
        * 2
        * shape.kv_heads
        * (shape.hidden // shape.heads)
        * w
    )


def _scores(shape: ModelShape, sequences: int) -> int:
    """Two fp32 (batch x vocab) score tensors of a generate call."""
    return _b(sequences * 2 * shape.vocab * 4)


def master_width(ds_config: dict) -> tuple[int, str]:
    """Bytes of one master weight (and of one Adam moment) and its name: bf16 where the resolved
    DeepSpeed config keeps bf16 master weights and optimizer states (lean bf16 mode,
    train.lean_bf16), else fp32."""
    bf16 = ds_config.get("bf16") or {}
    lean = (
        bf16.get("enabled")
        and bf16.get("bf16_master_weights_and_grads")
        and bf16.get("bf16_optimizer_states")
    )
    return (2, "bf16") if lean else (4, "fp32")


def _update_bytes(
    recipe: Recipe, shape: ModelShape, w: int, tp: int, tokens: int, longest: int, backend: str
) -> int:
    h, i, kv = (
        shape.hidden,
        shape.intermediate / tp,
        shape.kv_heads * (shape.hidden // shape.heads) / tp,
    )
    # Ulysses: a rank attends with 1/sp of the heads
    heads = shape.heads / tp / recipe.train.sequence_parallel_size
    # values a token saves in one layer besides its MLP's
    attention = 8 * h + 3 * kv + heads * longest
    dense, moe = (
        4 * i,
        shape.experts_per_token * (4 * shape.expert_intermediate + 3 * h) + 2 * shape.experts,
    )
    mlps = (shape.layers - shape.moe_layers) * dense + shape.moe_layers * moe
    if recipe.model.gradient_checkpointing:
        largest = attention + max(
            dense if shape.layers > shape.moe_layers else 0, moe if shape.moe_layers else 0
        )
        activations = tokens * (shape.layers * h + largest) * w
    else:
        activations = tokens * (shape.layers * attention + mlps) * w
    dtype = getattr(torch, recipe.model.dtype)
    k = recipe.kernels
    chunk = min(
        tokens,
        logprob_chunk_tokens(
            shape.vocab, dtype, backend, k.logprob_chunk_mib, k.logprob_chunk_tokens
        ),
    )
    head_adapted = lora.enabled(recipe.model) and "lm_head" in recipe.model.lora_target_modules
    fused = k.fused_lm_head and tp == 1 and not head_adapted  # grpo_ds.model.policy's rule
    working_set = chunk * chunk_bytes_per_token(shape.vocab, dtype, backend)
    logits = working_set if fused else tokens * shape.vocab * (2 * w) + working_set
    return _b(activations + logits)


def _b(value: float) -> int:
    return int(math.ceil(value))
