"""What the ``vllm`` engine (grpo_ds.rollout.vllm) asks of vLLM, and what it makes of the answers:
pure functions of the recipe and of vLLM's outputs, which import neither vLLM nor torch.

The recipe's settings (``VLLMSettings``) become vllm.LLM's arguments (``llm_kwargs``); a step's
sampling settings and each prompt's place become vllm.SamplingParams' arguments, with one seed per
prompt (``sampling_kwargs``, ``request_seeds``) or per agent turn (``turn_seed``); vLLM's
RequestOutputs become Rollouts (``rollouts_from_outputs``) or one agent Turn
(``turn_from_output``), malformed ones refused. Why the seeds and log-probs are what they are: the
"Sampling" paragraph of grpo_ds.rollout.vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grpo_ds.rollout.base import Rollouts, SamplingParams, Turn


@dataclass(frozen=True)
class VLLMSettings:
    """What the engine takes from the recipe."""

    model_path: str  # a local HF folder, or "builtin:tiny" (saved to a temporary folder for vLLM)
    dtype: str  # vLLM's weights and activations
    tensor_parallel_size: int
    gpu_memory_utilization: float  # on a CPU: the share of the machine's memory (vLLM's meaning)
    max_model_len: int
    # asked for; the engine sleeps only where vLLM has a sleep mode (sleep_mode_available)
    sleep_mode: bool
    seed: int
    trust_remote_code: bool
    enforce_eager: bool = False
    kv_cache_gib: float | None = None
    # vLLM's scheduler limits per engine step; None = vLLM's defaults
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    @staticmethod
    def from_recipe(recipe) -> VLLMSettings:
        r = recipe.rollout
        return VLLMSettings(
            recipe.model.path,
            r.vllm_dtype or recipe.model.dtype,
            r.vllm_tensor_parallel_size,
            r.vllm_gpu_memory_utilization,
            r.vllm_max_model_len or recipe.data.max_prompt_tokens + recipe.max_response_tokens,
            r.vllm_sleep_mode,
            recipe.run.seed,
            recipe.model.trust_remote_code,
            r.vllm_enforce_eager,
            r.vllm_kv_cache_gib,
            r.vllm_max_num_seqs,
            r.vllm_max_num_batched_tokens,
        )


def llm_kwargs(
    settings: VLLMSettings, model_folder: str, rank: int, on_cpu: bool, sleep: bool
) -> dict:
    """Keyword arguments of vllm.LLM for this rank (the members of a tensor-parallel group get the
    same seed). ``on_cpu``: vLLM's CPU build, whose KV cache size is the VLLM_CPU_KVCACHE_SPACE
    variable (set by the engine) instead of an argument; ``sleep``: sleep mode asked for and
    available."""
    tp = settings.tensor_parallel_size
    kwargs = {
        "model": model_folder,
        "dtype": settings.dtype,
        "seed": settings.seed + rank // tp,
        "tensor_parallel_size": tp,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_model_len": settings.max_model_len,
        "enable_sleep_mode": sleep,
        "distributed_executor_backend": "external_launcher",
        "logprobs_mode": "processed_logprobs",
        "trust_remote_code": settings.trust_remote_code,
        "enforce_eager": settings.enforce_eager,
    }
    if settings.kv_cache_gib is not None and not on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * 2**30)
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(settings, key) is not None:
            kwargs[key] = getattr(settings, key)
    return kwargs


def request_seeds(base: int, places: Sequence[int], group_size: int) -> list[int]:
    """One seed per prompt, from its place in the step's batch; vLLM seeds the prompt's k-th sample
    with seed + k, so seeds are group_size apart, and ``base`` (different per step, the same on
    every rank) is spread so that neighbouring bases do not share seeds."""
    start = (base * 1_000_003) % (2**31 - 1)
    return [(start + place * group_size) % (2**31 - 1) for place in places]


def sampling_kwargs(
    sampling: SamplingParams, group_size: int, stop_ids: Sequence[int], seed: int
) -> dict:
    """Keyword arguments of vllm.SamplingParams for one prompt: ``group_size`` samples, the sampled
    token's log-prob, generation stops at any of ``stop_ids`` (grpo_ds.rollout.stop: the ids vLLM
    would add itself, given explicitly so that the set is visibly the hf engine's) or after
    max_new_tokens; temperature 0 is greedy decoding."""
    greedy = sampling.temperature == 0
    return {
        "n": group_size,
        "temperature": sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0 if greedy else sampling.top_k,  # 0 = off (vLLM >= 0.17 takes 0 or -1)
        "max_tokens": sampling.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": list(stop_ids),
        "seed": seed,
    }


def rollouts_from_outputs(
    prompts: Sequence[list[int]], outputs: Sequence, group_size: int
) -> Rollouts:
    """vLLM's RequestOutputs (one per prompt, in prompt order) -> Rollouts, the group_size samples
    of a prompt consecutive. A sample's ``token_ids`` end with the stop token when ``finish_reason``
    is "stop"; its ``logprobs`` holds, per position, a mapping token id -> Logprob that contains the
    sampled token."""
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    result = Rollouts([], [], [], [])
    for prompt, request in zip(prompts, outputs, strict=True):
        samples = sorted(request.outputs, key=lambda c: c.index)
        if len(samples) != group_size:
            raise RuntimeError(
                f"vLLM returned {len(samples)} samples for a prompt, expected {group_size}"
            )
        for sample in samples:
            ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(ids):
                raise RuntimeError(
                    "vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0)"
                )
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample with {sample.finish_reason!r}")
            result.prompt_ids.append(list(prompt))
            result.response_ids.append(ids)
            result.sampler_logprobs.append(
                [
                    float(position[t].logprob)
                    for position, t in zip(sample.logprobs, ids, strict=True)
                ]
            )
            result.finish_reason.append(sample.finish_reason)
    return result


def turn_seed(base: int, key: int) -> int:
    """The seed of one agent turn request: ``key`` numbers the (episode, turn) within the step,
    ``base`` the step, mixed so that neighbouring keys and bases do not share seeds."""
    return (base * 1_000_003 + key * 7_919 + 12_345) % (2**31 - 1)


def turn_from_output(request, stop_ids: Sequence[int]) -> Turn:
    """One turn request's RequestOutput -> Turn: EOS when vLLM stopped at one of ``stop_ids`` (the
    last token), cut when it ran out of tokens ("length"); a stop string ends it with "stop" and a
    string stop_reason."""
    if len(request.outputs) != 1:
        raise RuntimeError(
            f"vLLM returned {len(request.outputs)} samples for a turn request, expected 1"
        )
    sample = request.outputs[0]
    ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(ids):
        raise RuntimeError(
            "vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0)"
        )
    if sample.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a turn with {sample.finish_reason!r}")
    eos = (
        sample.finish_reason == "stop"
        and not isinstance(sample.stop_reason, str)
        and bool(ids)
        and ids[-1] in stop_ids
    )
    return Turn(
        ids,
        [float(position[t].logprob) for position, t in zip(sample.logprobs, ids, strict=True)],
        eos=eos,
        cut=sample.finish_reason == "length",
    )
