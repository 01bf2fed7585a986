"""The recipe's schema: frozen dataclasses, one field per key.

Every default lives here and nowhere else. Each field declares its documentation, and where it
applies its allowed choices and numeric range, with ``opt`` (grpo_ds.config.options); validation,
``grpo_ds.check`` and the docs' key reference (docs/reference/recipe.md, generated) all read that
one declaration.

The schema knows nothing of loading or of its cross-key rules: grpo_ds.config.loading.load_recipe
reads a recipe into it and then runs the rules (grpo_ds.config.rules).
The DeepSpeed side (``train_batch_size`` and friends) is resolved in ``grpo_ds.config.deepspeed``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from grpo_ds.algo.names import ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, SCALES
from grpo_ds.config.dtypes import DTYPES
from grpo_ds.config.options import opt
from grpo_ds.config.reward_specs import ON_ERROR_CHOICES


@dataclass(frozen=True)
class RunConfig:
    name: str = opt("grpo", "Run name; the run folder is output_dir/name")
    output_dir: str = opt(
        "runs", "Folder that holds run folders (relative to the working directory)"
    )
    seed: int = opt(0, "Seed for data order, sampling and model init", low=0)
    overwrite: bool = opt(
        False, "Replace an existing run folder (otherwise a folder holding a run is an error)"
    )
    save_final_model: bool = opt(
        True, "Save the trained policy and tokenizer as a HF folder <run folder>/final_model"
    )
    preempt_grace_s: float = opt(
        25.0,
        "After a stop signal (SIGTERM, SIGUSR1, Ctrl-C) the run has exited within this "
        "many seconds: it finishes the step and checkpoints if it can, else abandons the step "
        "and resumes from the last checkpoint (SLURM's KillWait and DeepSpeed's launcher wait "
        "30 s before they kill)",
        low=2.0,
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt(
        "builtin:tiny", '"builtin:tiny" (random tiny model, no download) or a local HF model folder'
    )
    dtype: str = opt("float32", "Training dtype of the policy", choices=DTYPES)
    gradient_checkpointing: bool = opt(
        False, "Recompute activations in the backward pass to save memory"
    )
    trust_remote_code: bool = opt(False, "Allow a local model folder to run its own modelling code")
    tiny_hidden_size: int = opt(64, "builtin:tiny only: hidden size", low=8)
    tiny_num_layers: int = opt(2, "builtin:tiny only: number of transformer layers", low=1)
    tiny_num_heads: int = opt(
        4, "builtin:tiny only: attention heads (must divide tiny_hidden_size)", low=1
    )
    tiny_num_experts: int = opt(
        0,
        "builtin:tiny only: 0 = a dense Llama; N >= 1 = a mixture of experts in "
        "Qwen3-MoE's layout, N experts of intermediate size tiny_hidden_size in every layer "
        "(docs/guides/large-models.md)",
        low=0,
    )
    tiny_experts_per_token: int = opt(
        2,
        "builtin:tiny with tiny_num_experts: experts each token is routed to (top-k, "
        "at most tiny_num_experts)",
        low=1,
    )
    router_aux_loss_coef: float = opt(
        0.0,
        "Mixture-of-experts models only: weight c of the routers' "
        "load-balancing loss L_aux (Switch Transformer's, over one forward's tokens), "
        "added to every trained token's loss as c x L_aux of its micro-batch, so "
        "weighted as the policy loss is; the one term that depends on the micro-batch "
        "layout. 0 = off: RL starts from a trained router, and off keeps the step's "
        "loss independent of the layout (docs/guides/large-models.md)",
        low=0.0,
    )
    lora_rank: int | None = opt(
        None, "LoRA: rank of the adapters (extra grpo_ds[lora]); null trains every weight", low=1
    )
    lora_alpha: float = opt(
        16.0,
        "LoRA: the adapters' update is scaled by lora_alpha / lora_rank",
        low=0.0,
        low_open=True,
    )
    lora_dropout: float = opt(
        0.0, "LoRA: dropout on the adapters' input while training (0 <= p < 1)", low=0.0, high=0.99
    )
    lora_target_modules: list = opt(
        ["all-linear"],
        'LoRA: names of the linear modules to adapt, e.g. ["q_proj", '
        '"v_proj"], or ["all-linear"] (every linear layer except the output layer)',
    )


@dataclass(frozen=True)
class DataConfig:
    train: str = opt(
        "builtin:arith",
        '"builtin:arith", a .jsonl/.json/.parquet file, or a saved HF dataset folder',
    )
    prompt_key: str = opt("prompt", "Column holding the prompt text")
    answer_key: str = opt(
        "answer", "Column holding the reference answer (passed to reward functions)"
    )
    chat_template: bool = opt(
        False, "Wrap each prompt as a user message with the tokenizer's chat template"
    )
    max_prompt_tokens: int = opt(512, "Longest prompt in tokens; longer rows are bad rows", low=1)
    on_bad_row: str = opt(
        "error",
        "Row without the prompt key, empty, or too long: stop, or skip and count",
        choices=("error", "skip"),
    )
    shuffle: bool = opt(True, "Shuffle prompts each pass over the data (seeded by run.seed)")
    on_change: str = opt(
        "stop",
        "A resumed run whose data.train changed since it started (its size or content): "
        'stop with one line, or continue ("continue": a new pass over the changed data begins)',
        choices=("stop", "continue"),
    )


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


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: str = opt(
        "grpo",
        "Advantage estimator: grpo (group mean, group std), dr_grpo (group mean, no std), "
        "rloo (leave-one-out mean), reinforce_pp (batch mean, batch std)",
        choices=tuple(ESTIMATORS),
    )
    scale_rewards: str | None = opt(
        None,
        "Divide the centred rewards by the group std, the batch std, or nothing "
        "(null = the estimator's own: grpo group, reinforce_pp batch, else none)",
        choices=SCALES,
    )
    policy_loss: str = opt(
        "ppo_clip",
        "Policy loss: ppo_clip (token ratio) or gspo (sequence ratio, length-"
        "normalised; needs loss_agg seq-mean-token-mean)",
        choices=POLICY_LOSSES,
    )
    clip_low: float = opt(
        0.2, "PPO ratio lower clip: ratio >= 1 - clip_low", low=0.0, high=1.0, low_open=True
    )
    clip_high: float = opt(
        0.2, "PPO ratio upper clip: ratio <= 1 + clip_high (DAPO uses 0.28)", low=0.0, low_open=True
    )
    kl_coef: float = opt(
        0.0,
        "Weight of the KL penalty against the frozen reference model (0 = no reference)",
        low=0.0,
    )
    dual_clip: float | None = opt(
        None,
        "Dual clip: a negative-advantage token's loss is at most dual_clip * |A| "
        "(Ye et al. 2020; often 3; null = off)",
        low=1.0,
        low_open=True,
    )
    kl_in_reward: bool = opt(
        False,
        "Subtract kl_coef x the completion's summed KL from its reward (before "
        "advantages) instead of adding the KL to the loss",
    )
    kl_estimator: str = opt(
        "k3",
        "KL estimator, r = ref - policy log-prob: k1 = -r, k2 = r^2 / 2, "
        "k3 = exp(r) - r - 1 (Schulman 2020)",
        choices=KL_ESTIMATORS,
    )
    loss_agg: str = opt(
        "token-mean",
        "How per-token losses become one number per optimizer step",
        choices=LOSS_AGG_MODES,
    )
    loss_agg_norm_tokens: int | None = opt(
        None, "Constant divisor of seq-mean-token-sum-norm (null = rollout.max_new_tokens)", low=1
    )
    entropy_coef: float = opt(0.0, "Entropy bonus weight (loss -= entropy_coef * entropy)", low=0.0)
    dynamic_sampling: bool = opt(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and sample "
        "more prompts until prompts_per_step groups carry signal",
    )
    dynamic_sampling_max_rounds: int = opt(
        4,
        "Extra rollout rounds one step may draw for dynamic sampling; when "
        "spent, the step is topped up with equal-reward groups",
        low=0,
    )
    overlong_buffer_tokens: int | None = opt(
        None,
        "DAPO soft overlong penalty: completions longer than "
        "max_new_tokens - this lose up to overlong_penalty (null = off)",
        low=1,
    )
    overlong_penalty: float = opt(
        1.0,
        "Reward lost by a completion that reaches max_new_tokens (soft overlong "
        "penalty, linear over the buffer)",
        low=0.0,
    )
    mask_truncated: bool = opt(
        False,
        "Completions cut by max_new_tokens (or an agent's limits) get no loss "
        "(DAPO's overlong filtering)",
    )
    rollout_is_cap: float | None = opt(
        None,
        "Truncated importance sampling: weight each token's loss by "
        "min(pi_old / pi_sampler, cap) (null = off; e.g. 2)",
        low=1.0,
    )


@dataclass(frozen=True)
class TrainConfig:
    steps: int = opt(100, "Training steps (one rollout each)", low=1)
    samples_per_optimizer_step: int | None = opt(
        None,
        "Samples (completions) per optimizer step, global; must "
        "divide prompts_per_step * group_size (null = all of them)",
        low=1,
    )
    epochs_per_rollout: int = opt(1, "Passes over each step's samples", low=1)
    micro_batch_samples_per_gpu: int = opt(
        4, "Samples per micro-batch per GPU in the policy update", low=1
    )
    max_tokens_per_micro_batch: int | None = opt(
        None,
        "Dynamic batching: cap on the tokens of a micro-batch, all "
        "phases: real tokens when packing, else samples x longest "
        "sequence (null = off: micro_batch_samples_per_gpu)",
        low=1,
    )
    packing: bool = opt(
        True,
        "Pack a micro-batch's sequences into one row (position ids restart per sequence, no "
        "padding); false = one right-padded row per sequence",
    )
    logprob_micro_batch_samples_per_gpu: int = opt(
        8, "Samples per micro-batch per GPU in the old/ref log-prob passes", low=1
    )
    lr: float = opt(1e-6, "Peak learning rate (AdamW)", low=0.0, low_open=True)
    weight_decay: float = opt(0.0, "AdamW weight decay", low=0.0)
    adam_betas: list = opt([0.9, 0.999], "AdamW betas [beta1, beta2]")
    warmup_steps: int = opt(0, "Optimizer steps of linear learning-rate warm-up", low=0)
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this (0 = off)", low=0.0)
    max_nonfinite_steps: int = opt(
        3,
        "Stop after this many optimizer steps in a row with a non-finite loss or "
        "gradient norm (each one's update is skipped and logged)",
        low=1,
    )
    tensor_parallel_size: int = opt(
        1,
        "Ranks that split every layer of the policy (DeepSpeed AutoTP, "
        "tensor_parallel.autotp_size); samples are sharded over world size / this",
        low=1,
    )
    sequence_parallel_size: int = opt(
        1,
        "Ranks that split every sequence along its length (DeepSpeed Ulysses, "
        "ZeRO-3 only); samples are sharded over world size / this",
        low=1,
    )
    zero3_on_one_rank: bool = opt(
        False,
        "Keep ZeRO stage 3 when the run has one rank. By default a one-rank run of a "
        "stage-3 DeepSpeed file without offload trains with stage 1: one rank has nothing to "
        "partition, stage 1 keeps the same fp32 master weights and optimizer states, and "
        "skips ZeRO-3's gather and release around every module (benchmarks/"
        "bench_one_rank_stage.py)",
    )
    lean_bf16: bool = opt(
        False,
        "Lean bf16 mode (model.dtype bfloat16 only): keep the master weights, gradients and "
        "Adam moments in bf16, as TRL does, instead of fp32 master weights and moments "
        "(DeepSpeed's bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states): 10 "
        "instead of 16 bytes a trained parameter (8 at one rank), traded for precision (updates "
        "below bf16's resolution of a weight are lost); ZeRO 1-3, no offloaded optimizer",
    )


# grpo_ds.config.software.resolve_backend resolves "auto"
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelsConfig:
    backend: str = opt(
        "auto",
        "Per-token math: Triton kernels or the chunked PyTorch path (auto = triton on CUDA "
        "when installed, else torch)",
        choices=BACKENDS,
    )
    logprob_chunk_mib: float = opt(
        64.0,
        "Working-set budget of one chunk of log-probs, entropy and the loss, in MiB: "
        "the tokens per chunk follow from the vocabulary, dtype and backend (a chunk's "
        "logits, plus float32 probabilities on the torch backend)",
        low=0,
        low_open=True,
    )
    logprob_chunk_tokens: int | None = opt(
        None,
        "Tokens per chunk, overriding logprob_chunk_mib (null = as many as the budget holds)",
        low=1,
    )
    fused_lm_head: bool = opt(
        True,
        "Compute log-probs from hidden states and the lm_head weight so full logits "
        "never exist (false = full logits, then the logits kernels)",
    )


@dataclass(frozen=True)
class EvalConfig:
    data: str | None = opt(
        None,
        "Held-out prompts scored during training, same formats and columns as data.train "
        "(null = no evaluation)",
    )
    every_steps: int = opt(50, "Evaluate every this many steps and after the last step", low=1)
    max_prompts: int | None = opt(
        None, "Use only the first this many eval prompts (null = all)", low=1
    )
    samples_per_prompt: int = opt(4, "Sampled answers per prompt for pass@k (n)", low=1)
    pass_at: list = opt([1], "The k values of pass@k reported, each <= samples_per_prompt")
    temperature: float = opt(
        1.0,
        "Sampling temperature of the pass@k answers (greedy accuracy uses greedy decoding)",
        low=0.0,
        low_open=True,
    )
    correct_at: float = opt(1.0, "An answer is correct when its total reward is at least this")


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int | None = opt(
        50, "Save a checkpoint every this many steps, and after the last step (null = never)", low=1
    )
    keep: int = opt(
        2, "Newest checkpoints kept; older ones are deleted once a newer one is complete", low=1
    )
    resume: str = opt(
        "auto",
        '"auto": continue from the newest good checkpoint in the run folder; "never": a run '
        "folder that holds a run is an error; or the path of a checkpoint folder to start from",
    )


@dataclass(frozen=True)
class LoggingConfig:
    every_steps: int = opt(
        1,
        "Print a metrics line every this many steps, and at the first and the last "
        "(metrics.jsonl gets every step)",
        low=1,
    )
    progress_bar: bool = opt(
        True,
        "Show a progress bar on rank 0, where stderr is a terminal (in a log file the "
        "step lines of every_steps are the progress)",
    )
    tensorboard: bool = opt(
        False, "Write TensorBoard event files to <run folder>/tensorboard (extra: tensorboard)"
    )
    wandb_project: str | None = opt(
        None, "Log every step to this Weights & Biases project (extra: wandb; null = off)"
    )
    samples_every_steps: int | None = opt(
        10,
        "Every this many steps, write a few (prompt, completion, reward) "
        "records to <run folder>/samples.jsonl (null = never)",
        low=1,
    )
    samples_per_log: int = opt(4, "Samples written each time (the first group's first ones)", low=1)
    wandb_mode: str = opt(
        "online",
        "Weights & Biases mode (offline writes to <run folder>/wandb)",
        choices=("online", "offline", "disabled"),
    )
    profile_steps: list | None = opt(
        None,
        "[first, last]: record a torch.profiler trace of these steps (inclusive, "
        "at most 10 with profile_trace) per rank to <run folder>/profile/"
        "rank<r>.pt.trace.json, phases labelled grpo/<phase>, and their memory timeline "
        "to rank<r>.memory.csv (null = off)",
    )
    profile_trace: bool = opt(
        True,
        "With profile_steps: record the torch.profiler trace (false = only the memory "
        "timeline, without the profiler's own buffers in it)",
    )
    profile_comms: bool = opt(
        False,
        "With profile_steps: also log DeepSpeed's collectives of those steps (op, "
        "message size, count) per rank to <run folder>/profile/rank<r>.comms.txt",
    )
    memory_sample_ms: int = opt(
        10,
        "With profile_steps: sample this process's memory (RSS, RssAnon; CUDA allocated "
        "and reserved on a GPU) every this many milliseconds, and at every phase boundary",
        low=1,
    )


@dataclass(frozen=True)
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deepspeed: Any = field(
        default="ds_configs/zero3.json",
        metadata={
            "doc": 'DeepSpeed config: path to a JSON file (batch keys "auto") or an inline object'
        },
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # folder of the recipe file
    source_dir: str = field(default=".", compare=False, metadata={"internal": True})

    @property
    def samples_per_step(self) -> int:
        """P x G: completions generated and trained on per step."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def samples_per_optimizer_step(self) -> int:
        return self.train.samples_per_optimizer_step or self.samples_per_step

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return (
            self.samples_per_step // self.samples_per_optimizer_step * self.train.epochs_per_rollout
        )

    @property
    def advantage_baseline_and_scale(self) -> tuple[str, str]:
        """(baseline, scale) for grpo_ds.algo.advantages.group_advantages."""
        baseline, scale = ESTIMATORS[self.algorithm.advantage]
        return baseline, self.algorithm.scale_rewards or scale

    @property
    def max_response_tokens(self) -> int:
        """Longest possible response: max_new_tokens, or an agent episode's total budget."""
        r = self.rollout
        return (r.max_total_tokens or r.max_new_tokens) if r.engine == "agent" else r.max_new_tokens

    @property
    def uses_vllm(self) -> bool:
        """vLLM generates: the vllm engine, or the agent engine's turns with agent_backend
        "vllm"."""
        r = self.rollout
        return r.engine == "vllm" or (r.engine == "agent" and r.agent_backend == "vllm")

    @property
    def loss_agg_norm_tokens(self) -> int:
        return self.algorithm.loss_agg_norm_tokens or self.max_response_tokens

    @property
    def sequence_parallel_rows(self) -> int:
        """Rows of every micro-batch under sequence parallelism (DeepSpeed's Ulysses wrapper is
        built for one row count): the larger of the update and log-prob micro sizes."""
        t = self.train
        return max(t.micro_batch_samples_per_gpu, t.logprob_micro_batch_samples_per_gpu)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source_dir")
        return out


_RECIPE_HINTS = typing.get_type_hints(Recipe)
SECTIONS: dict[str, type] = {
    f.name: _RECIPE_HINTS[f.name]
    for f in dataclasses.fields(Recipe)
    if dataclasses.is_dataclass(_RECIPE_HINTS[f.name])
}
TOP_LEVEL_VALUES = ("deepspeed",)


def iter_fields():
    """Yield (section, dataclasses.Field) for every user-facing key, in schema order (docs and
    tests)."""
    for f in dataclasses.fields(Recipe):
        if f.metadata.get("internal"):
            continue
        if f.name in SECTIONS:
            for sub in dataclasses.fields(SECTIONS[f.name]):
                yield f.name, sub
        else:
            yield None, f
