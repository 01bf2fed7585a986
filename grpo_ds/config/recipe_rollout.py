"""The recipe's ``rollout`` and ``reward`` sections: how completions are generated, and how they are
scored.

Part of the recipe's schema (grpo_ds.config.recipe composes the sections into the ``Recipe``): each
key declared with ``opt`` (grpo_ds.config.options), its default written here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_ds.config.dtypes import DTYPES
from grpo_ds.config.options import opt
from grpo_ds.config.reward_specs import ON_ERROR_CHOICES


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = opt(
        "hf",
        "Generation engine: hf (transformers generate with the policy itself at ZeRO 0-2 without "
        "tp or sp, else with an unsharded copy), agent (multi-turn: model turns and an "
        "environment's observations) or vllm (on every GPU; extra grpo_ds[vllm])",
        choices=("hf", "agent", "vllm"),
    )
    prompts_per_step: int = opt(
        8, "Prompts sampled per training step (global, all ranks together)", low=1
    )
    group_size: int = opt(
        8, "Completions sampled per prompt; advantages are computed within a group", low=2
    )
    max_new_tokens: int = opt(
        256,
        "Longest completion in tokens (agent: longest model turn); generation also stops at EOS",
        low=1,
    )
    temperature: float = opt(
        1.0,
        "Sampling temperature; the trainer's log-probs are those of softmax(logits / temperature)",
        low=0.0,
        low_open=True,
    )
    top_p: float = opt(
        1.0,
        "Nucleus sampling: keep the smallest token set with this much probability (after "
        "top_k). The trainer takes every log-prob, the KL and the entropy over the set the sampler "
        "drew from, so importance weights stay 1 at "
        "staleness 0 (docs/concepts/truncated-sampling.md)",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    top_k: int = opt(
        0,
        "Keep only the k most likely tokens (0 = off); like top_p, replayed by the trainer over "
        "the same set (docs/concepts/truncated-sampling.md)",
        low=0,
    )
    generation_batch_prompts: int = opt(
        64, "Prompts per generate() call on each rank (bounds rollout memory)", low=1
    )
    hf_compile: str = opt(
        "auto",
        "hf engine: decode with a static KV cache and a torch.compile'd step (CUDA "
        "graphs on a GPU) instead of eagerly; the same token picking and sampler log-probs, logits "
        "equal to float rounding. auto = on CUDA (an H200's rollout phase: 2.0 s a step against "
        "6.5 s for TRL's eager generate, benchmarks/RESULTS.md 2026-11-28), off on a CPU (it does "
        "not pay there). Keeps its KV caches on the device between steps (docs/guides/vllm.md); a "
        "compile that fails or stalls falls back to eager with one line",
        choices=("auto", "on", "off"),
    )
    hf_compile_timeout_s: float = opt(
        300.0,
        "hf engine with hf_compile: seconds a compiled generate call may go "
        "without a new token (the first decode step waits for the compile) before "
        "the engine gives up and generates eagerly for the rest of the run",
        low=0.0,
        low_open=True,
    )
    placement: str = opt(
        "colocated",
        "Where generation runs: colocated (every rank generates its share, then "
        "trains) or split (the last rollout.ranks ranks only generate, the others form the ZeRO-3 "
        "trainer, and weights travel to them after every step); docs/guides/placement.md",
        choices=("colocated", "split"),
    )
    ranks: int = opt(
        1,
        "split: how many ranks (the last ones) only generate; at least 1 and fewer than the world "
        "size",
        low=1,
    )
    max_staleness: int = opt(
        0,
        "split: how many optimizer steps the rollout ranks may run ahead: a sample trained at "
        "step k was generated with the weights of step k-1-max_staleness or newer (0 = the two "
        "sides take turns, the same samples and losses as colocated)",
        low=0,
    )
    continuous: bool = opt(
        False,
        "split: continuous generation: the rollout engine holds the groups of several steps in "
        "one running batch, admits a step's groups as others end and loads new weights between "
        "two decode steps (each token records its weight version), instead of generating each "
        "step's batch to its longest completion; a step still trains exactly its own prompts, in "
        "order. hf and vllm engines (one engine per rollout rank: each decodes its own groups of "
        "every step), no dynamic sampling for now; "
        "docs/guides/placement.md",
    )
    transfer_timeout_s: float = opt(
        600.0,
        "split: seconds a transfer between the trainer and the rollout ranks (a "
        "batch of samples, the weights) may wait for the other side before the run stops "
        "naming the side that stalled",
        low=0.0,
        low_open=True,
    )
    weight_sync_bucket_mb: float = opt(
        256.0,
        "Size of each bucket of gathered ZeRO-3 weights sent to the rollout engine",
        low=0.0,
        low_open=True,
    )
    env: str | None = opt(
        None, 'agent: the environment, a built-in ("calculator") or "package.module:Class"'
    )
    env_options: dict = opt({}, "agent: keyword arguments of the environment's constructor")
    max_turns: int = opt(4, "agent: most model turns per episode", low=1)
    max_total_tokens: int | None = opt(
        None,
        "agent: response budget, model and observation tokens together (null = max_new_tokens)",
        low=1,
    )
    agent_backend: str = opt(
        "hf",
        "agent: what samples the model turns: transformers generate (hf) or vLLM (vllm; "
        "the vllm_* keys apply)",
        choices=("hf", "vllm"),
    )
    vllm_gpu_memory_utilization: float = opt(
        0.5,
        "vllm: share of each GPU's memory vLLM takes for its weights and "
        "KV cache (the trainer's resident states must fit in the rest); on a "
        "CPU, vLLM's meaning: the share of the machine's memory per engine",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    vllm_kv_cache_gib: float | None = opt(
        None,
        "vllm: KV cache size per engine in GiB (null = what "
        "vllm_gpu_memory_utilization leaves); on a CPU vLLM's "
        "VLLM_CPU_KVCACHE_SPACE, rounded up to whole GiB",
        low=0.0,
        low_open=True,
    )
    vllm_tensor_parallel_size: int = opt(
        1,
        "vllm: devices per vLLM engine (tensor parallel: GPUs, or CPU ranks); "
        "must divide the world size",
        low=1,
    )
    vllm_max_model_len: int | None = opt(
        None,
        "vllm: longest prompt + completion vLLM plans its KV cache for (null "
        "= data.max_prompt_tokens + max_new_tokens)",
        low=1,
    )
    vllm_sleep_mode: bool = opt(
        False,
        "vllm: release vLLM's GPU memory between generations (weights to CPU "
        "memory, KV cache dropped) so the trainer can use it; skipped, with a note, where "
        "vLLM has no sleep mode (its CPU build)",
    )
    vllm_enforce_eager: bool = opt(
        False,
        "vllm: run the model eagerly, without CUDA graphs or torch.compile: "
        "start-up in seconds instead of ~30 s of compiling, slower generation",
    )
    vllm_dtype: str | None = opt(
        None, "vllm: dtype of vLLM's weights and activations (null = model.dtype)", choices=DTYPES
    )
    vllm_max_num_seqs: int | None = opt(
        None,
        "vllm: most sequences vLLM schedules in one engine step (its max_num_seqs; null = "
        "vLLM's default, 256 on a CPU). A step whose prompts x group_size is above it is "
        "generated in waves; raising it to the step's samples (with "
        "vllm_max_num_batched_tokens) lets many short completions go in one wave",
        low=1,
    )
    vllm_max_num_batched_tokens: int | None = opt(
        None,
        "vllm: most tokens vLLM computes in one engine step, prompts' prefill included (its "
        "max_num_batched_tokens; null = vLLM's default, 4096 on a CPU); at least "
        "vllm_max_num_seqs",
        low=1,
    )


@dataclass(frozen=True)
class RewardConfig:
    functions: list = opt(
        [{"name": "exact_match", "weight": 1.0}],
        'Reward functions: [{"name": builtin or "package.module:function", "weight": float}]',
    )
    models: list = opt(
        [],
        'Learned reward models: [{"path": a local HF sequence-classification folder with one '
        'label, "weight": float, ...}], scored on every trainer rank (see reward.models[] below '
        "and docs/guides/reward-models.md)",
    )
    on_error: str = opt(
        "zero",
        "A function that raises, times out or returns a bad value: score 0 and count "
        "it, or stop the run",
        choices=ON_ERROR_CHOICES,
    )
    timeout_s: float = opt(
        30.0,
        "Seconds one reward function call (one chunk) may take; past it, the call fails "
        "and its worker process is killed and replaced",
        low=0.0,
        low_open=True,
    )
    processes: int | None = opt(
        None,
        "Reward worker processes on rank 0, started once per run: a crash or a "
        "timeout costs one chunk, not the run (null = one per CPU core this process may use, "
        "at most 8; 0 = call the functions in the trainer's process, without containment)",
        low=0,
    )
    chunk_samples: int = opt(
        64,
        "Completions per reward call, rounded up to whole groups: each function is called "
        "once per chunk, in any worker, so scores do not depend on reward.processes",
        low=1,
    )
    worker_memory_gib: float | None = opt(
        None,
        "Bound each reward worker's address space (RLIMIT_AS) to this many "
        "GiB: an allocation past it raises MemoryError in the function (null = no "
        "bound)",
        low=0.0,
        low_open=True,
    )
