"""The recipe: schema (frozen dataclasses), loading and cross-field validation.

Every default lives here and nowhere else. Each field declares its documentation, and where it
applies its allowed choices and numeric range, in ``field(metadata=...)``; validation, ``grpo_ds.check``
and the README's key reference all read that one declaration.

Load order (nothing touches a model): JSON file -> ``section.key=value`` overrides -> type, choice
and range checks per field (grpo_ds.config.parse) -> cross-field checks (batch algebra, here) -> a frozen
``Recipe``.
The DeepSpeed side (``train_batch_size`` and friends) is resolved in ``grpo_ds.config.deepspeed``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_ds.algo.names import ESTIMATORS, SCALES
from grpo_ds.algo.names import LOSS_AGG_MODES
from grpo_ds.algo.names import KL_ESTIMATORS
from grpo_ds.algo.names import POLICY_LOSSES
from grpo_ds.errors import UserError
from grpo_ds.config.software import BACKENDS
from grpo_ds.config.parse import apply_override, build, normalise_overrides, printable, read_json_object
from grpo_ds.config.reward_specs import parse_reward_specs
from grpo_ds.config.reward_specs import ON_ERROR_CHOICES

_MISSING = object()


def opt(default: Any, doc: str, *, choices: tuple | None = None, low: float | None = None,
        high: float | None = None, low_open: bool = False) -> Any:
    """Declare a recipe field: its default, a one-line doc, and optionally allowed choices or a range.

    ``low``/``high`` bound numbers inclusively; ``low_open`` makes the lower bound exclusive.
    """
    meta = {"doc": doc, "choices": choices, "low": low, "high": high, "low_open": low_open}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunConfig:
    name: str = opt("grpo", "Run name; the run folder is output_dir/name")
    output_dir: str = opt("runs", "Folder that holds run folders (relative to the working directory)")
    seed: int = opt(0, "Seed for data order, sampling and model init", low=0)
    overwrite: bool = opt(False, "Replace an existing run folder (otherwise a folder holding a run is an error)")
    save_final_model: bool = opt(True, "Save the trained policy and tokenizer as a HF folder <run folder>/final_model")


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt("builtin:tiny", '"builtin:tiny" (random tiny model, no download) or a local HF model folder')
    dtype: str = opt("float32", "Training dtype of the policy", choices=("float32", "bfloat16", "float16"))
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass to save memory")
    trust_remote_code: bool = opt(False, "Allow a local model folder to run its own modelling code")
    tiny_hidden_size: int = opt(64, "builtin:tiny only: hidden size", low=8)
    tiny_num_layers: int = opt(2, "builtin:tiny only: number of transformer layers", low=1)
    tiny_num_heads: int = opt(4, "builtin:tiny only: attention heads (must divide tiny_hidden_size)", low=1)
    lora_rank: int | None = opt(None, "LoRA: rank of the adapters (extra grpo_ds[lora]); null trains every weight",
                                low=1)
    lora_alpha: float = opt(16.0, "LoRA: the adapters' update is scaled by lora_alpha / lora_rank", low=0.0,
                            low_open=True)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input while training (0 <= p < 1)", low=0.0,
                              high=0.99)
    lora_target_modules: list = opt(["all-linear"], 'LoRA: names of the linear modules to adapt, e.g. ["q_proj", '
                                    '"v_proj"], or ["all-linear"] (every linear layer except the output layer)')


@dataclass(frozen=True)
class DataConfig:
    train: str = opt("builtin:arith", '"builtin:arith", a .jsonl/.json/.parquet file, or a saved HF dataset folder')
    prompt_key: str = opt("prompt", "Column holding the prompt text")
    answer_key: str = opt("answer", "Column holding the reference answer (passed to reward functions)")
    chat_template: bool = opt(False, "Wrap each prompt as a user message with the tokenizer's chat template")
    max_prompt_tokens: int = opt(512, "Longest prompt in tokens; longer rows are bad rows", low=1)
    on_bad_row: str = opt("error", "Row without the prompt key, empty, or too long: stop, or skip and count",
                          choices=("error", "skip"))
    shuffle: bool = opt(True, "Shuffle prompts each pass over the data (seeded by run.seed)")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = opt("hf", "Generation engine: hf (transformers generate with the policy itself at ZeRO 0-2 without "
                      "tp or sp, else with an unsharded copy), agent (multi-turn: model turns and an environment's "
                      "observations) or vllm (on every GPU; extra grpo_ds[vllm])", choices=("hf", "agent", "vllm"))
    prompts_per_step: int = opt(8, "Prompts sampled per training step (global, all ranks together)", low=1)
    group_size: int = opt(8, "Completions sampled per prompt; advantages are computed within a group", low=2)
    max_new_tokens: int = opt(256, "Longest completion in tokens (agent: longest model turn); generation also "
                              "stops at EOS", low=1)
    temperature: float = opt(1.0, "Sampling temperature", low=0.0, low_open=True)
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest token set with this much probability", low=0.0,
                       high=1.0, low_open=True)
    top_k: int = opt(0, "Keep only the k most likely tokens (0 = off)", low=0)
    generation_batch_prompts: int = opt(64, "Prompts per generate() call on each rank (bounds rollout memory)",
                                        low=1)
    weight_sync_bucket_mb: float = opt(256.0, "Size of each bucket of gathered ZeRO-3 weights sent to the "
                                       "rollout engine", low=0.0, low_open=True)
    env: str | None = opt(None, 'agent: the environment, a built-in ("calculator") or "package.module:Class"')
    env_options: dict = opt({}, "agent: keyword arguments of the environment's constructor")
    max_turns: int = opt(4, "agent: most model turns per episode", low=1)
    max_total_tokens: int | None = opt(None, "agent: response budget, model and observation tokens together "
                                       "(null = max_new_tokens)", low=1)
    vllm_gpu_memory_utilization: float = opt(0.5, "vllm: share of each GPU's memory vLLM takes for its weights and "
                                             "KV cache (the trainer's resident states must fit in the rest)",
                                             low=0.0, high=1.0, low_open=True)
    vllm_tensor_parallel_size: int = opt(1, "vllm: GPUs per vLLM engine (tensor parallel); must divide the world "
                                         "size", low=1)
    vllm_max_model_len: int | None = opt(None, "vllm: longest prompt + completion vLLM plans its KV cache for (null "
                                         "= data.max_prompt_tokens + max_new_tokens)", low=1)
    vllm_sleep_mode: bool = opt(False, "vllm: release vLLM's GPU memory between generations (weights to CPU "
                                "memory, KV cache dropped) so the trainer can use it")
    vllm_dtype: str | None = opt(None, "vllm: dtype of vLLM's weights and activations (null = model.dtype)",
                                 choices=("bfloat16", "float16", "float32"))


@dataclass(frozen=True)
class RewardConfig:
    functions: list = opt([{"name": "exact_match", "weight": 1.0}],
                          'Reward functions: [{"name": builtin or "package.module:function", "weight": float}]')
    on_error: str = opt("zero", "A function that raises, times out or returns a bad value: score 0 and count "
                        "it, or stop the run", choices=ON_ERROR_CHOICES)
    timeout_s: float = opt(30.0, "Seconds one reward function call may take for a whole batch", low=0.0,
                           low_open=True)


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: str = opt("grpo", "Advantage estimator: grpo (group mean, group std), dr_grpo (group mean, no std), "
                         "rloo (leave-one-out mean), reinforce_pp (batch mean, batch std)",
                         choices=tuple(ESTIMATORS))
    scale_rewards: str | None = opt(None, "Divide the centred rewards by the group std, the batch std, or nothing "
                                    "(null = the estimator's own: grpo group, reinforce_pp batch, else none)",
                                    choices=SCALES)
    policy_loss: str = opt("ppo_clip", "Policy loss: ppo_clip (token ratio) or gspo (sequence ratio, length-"
                           "normalised; needs loss_agg seq-mean-token-mean)", choices=POLICY_LOSSES)
    clip_low: float = opt(0.2, "PPO ratio lower clip: ratio >= 1 - clip_low", low=0.0, high=1.0, low_open=True)
    clip_high: float = opt(0.2, "PPO ratio upper clip: ratio <= 1 + clip_high (DAPO uses 0.28)", low=0.0,
                           low_open=True)
    kl_coef: float = opt(0.0, "Weight of the KL penalty against the frozen reference model (0 = no reference)",
                         low=0.0)
    dual_clip: float | None = opt(None, "Dual clip: a negative-advantage token's loss is at most dual_clip * |A| "
                                  "(Ye et al. 2020; often 3; null = off)", low=1.0, low_open=True)
    kl_in_reward: bool = opt(False, "Subtract kl_coef x the completion's summed KL from its reward (before "
                             "advantages) instead of adding the KL to the loss")
    kl_estimator: str = opt("k3", "KL estimator, r = ref - policy log-prob: k1 = -r, k2 = r^2 / 2, "
                            "k3 = exp(r) - r - 1 (Schulman 2020)", choices=KL_ESTIMATORS)
    loss_agg: str = opt("token-mean", "How per-token losses become one number per optimizer step",
                        choices=LOSS_AGG_MODES)
    loss_agg_norm_tokens: int | None = opt(None, "Constant divisor of seq-mean-token-sum-norm (null = "
                                           "rollout.max_new_tokens)", low=1)
    entropy_coef: float = opt(0.0, "Entropy bonus weight (loss -= entropy_coef * entropy)", low=0.0)
    dynamic_sampling: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and sample "
                                 "more prompts until prompts_per_step groups carry signal")
    dynamic_sampling_max_rounds: int = opt(4, "Extra rollout rounds one step may draw for dynamic sampling; when "
                                           "spent, the step is topped up with equal-reward groups", low=0)
    overlong_buffer_tokens: int | None = opt(None, "DAPO soft overlong penalty: completions longer than "
                                             "max_new_tokens - this lose up to overlong_penalty (null = off)", low=1)
    overlong_penalty: float = opt(1.0, "Reward lost by a completion that reaches max_new_tokens (soft overlong "
                                  "penalty, linear over the buffer)", low=0.0)
    mask_truncated: bool = opt(False, "Completions cut by max_new_tokens (or an agent's limits) get no loss "
                               "(DAPO's overlong filtering)")
    rollout_is_cap: float | None = opt(None, "Truncated importance sampling: weight each token's loss by "
                                       "min(pi_old / pi_sampler, cap) (null = off; e.g. 2)", low=1.0)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = opt(100, "Training steps (one rollout each)", low=1)
    samples_per_optimizer_step: int | None = opt(None, "Samples (completions) per optimizer step, global; must "
                                                 "divide prompts_per_step * group_size (null = all of them)",
                                                 low=1)
    epochs_per_rollout: int = opt(1, "Passes over each step's samples", low=1)
    micro_batch_samples_per_gpu: int = opt(4, "Samples per micro-batch per GPU in the policy update", low=1)
    max_tokens_per_micro_batch: int | None = opt(None, "Dynamic batching: cap on the tokens of a micro-batch, all "
                                                 "phases: real tokens when packing, else samples x longest "
                                                 "sequence (null = off: micro_batch_samples_per_gpu)", low=1)
    packing: bool = opt(True, "Pack a micro-batch's sequences into one row (position ids restart per sequence, no "
                        "padding); false = one right-padded row per sequence")
    logprob_micro_batch_samples_per_gpu: int = opt(8, "Samples per micro-batch per GPU in the old/ref log-prob "
                                                   "passes", low=1)
    lr: float = opt(1e-6, "Peak learning rate (AdamW)", low=0.0, low_open=True)
    weight_decay: float = opt(0.0, "AdamW weight decay", low=0.0)
    adam_betas: list = opt([0.9, 0.999], "AdamW betas [beta1, beta2]")
    warmup_steps: int = opt(0, "Optimizer steps of linear learning-rate warm-up", low=0)
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this (0 = off)", low=0.0)
    max_nonfinite_steps: int = opt(3, "Stop after this many optimizer steps in a row with a non-finite loss or "
                                   "gradient norm (each one's update is skipped and logged)", low=1)
    tensor_parallel_size: int = opt(1, "Ranks that split every layer of the policy (DeepSpeed AutoTP, "
                                    "tensor_parallel.autotp_size); samples are sharded over world size / this", low=1)
    sequence_parallel_size: int = opt(1, "Ranks that split every sequence along its length (DeepSpeed Ulysses, "
                                      "ZeRO-3 only); samples are sharded over world size / this", low=1)
    zero3_on_one_rank: bool = opt(False, "Keep ZeRO stage 3 when the run has one rank. By default a one-rank run of a "
                                  "stage-3 DeepSpeed file without offload trains with stage 1: one rank has nothing to "
                                  "partition, stage 1 keeps the same fp32 master weights and optimizer states, and "
                                  "skips ZeRO-3's gather and release around every module (benchmarks/"
                                  "bench_one_rank_stage.py)")


@dataclass(frozen=True)
class KernelsConfig:
    backend: str = opt("auto", "Per-token math: Triton kernels or the chunked PyTorch path (auto = triton on CUDA "
                       "when installed, else torch)", choices=BACKENDS)
    logprob_chunk_tokens: int = opt(512, "Tokens per chunk for log-probs, entropy and the loss: bounds memory to "
                                    "one chunk of logits", low=1)
    fused_lm_head: bool = opt(True, "Compute log-probs from hidden states and the lm_head weight so full logits "
                              "never exist (false = full logits, then the logits kernels)")


@dataclass(frozen=True)
class EvalConfig:
    data: str | None = opt(None, "Held-out prompts scored during training, same formats and columns as data.train "
                           "(null = no evaluation)")
    every_steps: int = opt(50, "Evaluate every this many steps and after the last step", low=1)
    max_prompts: int | None = opt(None, "Use only the first this many eval prompts (null = all)", low=1)
    samples_per_prompt: int = opt(4, "Sampled answers per prompt for pass@k (n)", low=1)
    pass_at: list = opt([1], "The k values of pass@k reported, each <= samples_per_prompt")
    temperature: float = opt(1.0, "Sampling temperature of the pass@k answers (greedy accuracy uses greedy "
                             "decoding)", low=0.0, low_open=True)
    correct_at: float = opt(1.0, "An answer is correct when its total reward is at least this")


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int | None = opt(50, "Save a checkpoint every this many steps, and after the last step (null = "
                                  "never)", low=1)
    keep: int = opt(2, "Newest checkpoints kept; older ones are deleted once a newer one is complete", low=1)
    resume: str = opt("auto", '"auto": continue from the newest good checkpoint in the run folder; "never": a run '
                      "folder that holds a run is an error; or the path of a checkpoint folder to start from")


@dataclass(frozen=True)
class LoggingConfig:
    every_steps: int = opt(1, "Print a metrics line every this many steps, and at the first and the last "
                           "(metrics.jsonl gets every step)", low=1)
    progress_bar: bool = opt(True, "Show a progress bar on rank 0")
    tensorboard: bool = opt(False, "Write TensorBoard event files to <run folder>/tensorboard (extra: tensorboard)")
    wandb_project: str | None = opt(None, "Log every step to this Weights & Biases project (extra: wandb; null = off)")
    samples_every_steps: int | None = opt(10, "Every this many steps, write a few (prompt, completion, reward) "
                                          "records to <run folder>/samples.jsonl (null = never)", low=1)
    samples_per_log: int = opt(4, "Samples written each time (the first group's first ones)", low=1)
    wandb_mode: str = opt("online", "Weights & Biases mode (offline writes to <run folder>/wandb)",
                          choices=("online", "offline", "disabled"))
    profile_steps: list | None = opt(None, "[first, last]: record a torch.profiler trace of these steps (inclusive, "
                                     "at most 10) per rank to <run folder>/profile/rank<r>.pt.trace.json, phases "
                                     "labelled grpo/<phase> (null = off)")
    profile_comms: bool = opt(False, "With profile_steps: also log DeepSpeed's collectives of those steps (op, "
                              "message size, count) per rank to <run folder>/profile/rank<r>.comms.txt")


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
    deepspeed: Any = field(default="ds_configs/zero3.json", metadata={
        "doc": "DeepSpeed config: path to a JSON file (batch keys \"auto\") or an inline object"})
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source_dir: str = field(default=".", compare=False, metadata={"internal": True})  # folder of the recipe file

    @property
    def samples_per_step(self) -> int:
        """P x G: completions generated and trained on per step."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def samples_per_optimizer_step(self) -> int:
        return self.train.samples_per_optimizer_step or self.samples_per_step

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.samples_per_step // self.samples_per_optimizer_step * self.train.epochs_per_rollout

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
    def loss_agg_norm_tokens(self) -> int:
        return self.algorithm.loss_agg_norm_tokens or self.max_response_tokens

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source_dir")
        return out


_RECIPE_HINTS = typing.get_type_hints(Recipe)
SECTIONS: dict[str, type] = {f.name: _RECIPE_HINTS[f.name] for f in dataclasses.fields(Recipe)
                             if dataclasses.is_dataclass(_RECIPE_HINTS[f.name])}
TOP_LEVEL_VALUES = ("deepspeed",)


def iter_fields():
    """Yield (section, dataclasses.Field) for every user-facing key, in schema order (docs and tests)."""
    for f in dataclasses.fields(Recipe):
        if f.metadata.get("internal"):
            continue
        if f.name in SECTIONS:
            for sub in dataclasses.fields(SECTIONS[f.name]):
                yield f.name, sub
        else:
            yield None, f


# ----------------------------------------------------------------------------------------- loading

def load_recipe(source: str | Path | dict, overrides: list[str] | dict | None = None) -> Recipe:
    """Read a recipe (JSON path or dict), apply overrides, validate everything; raise UserError if bad."""
    if isinstance(source, dict):
        raw, where, source_dir = json.loads(json.dumps(source)), "recipe", "."
    else:
        path = Path(source)
        where, source_dir = str(path), str(path.parent)
        if not path.is_file():
            what = "is a folder, not a recipe file" if path.is_dir() else "recipe file not found"
            raise UserError(printable(where), what, "check the path, e.g. recipes/tiny_cpu.json")
        raw = read_json_object(path, "a recipe", '{"run": {...}, ...}')
    for key, value in normalise_overrides(overrides):
        apply_override(raw, key, value, SECTIONS, TOP_LEVEL_VALUES)
    recipe = build(Recipe, raw, where, source_dir, SECTIONS, TOP_LEVEL_VALUES)
    validate(recipe)
    return recipe


# -------------------------------------------------------------------------------------- validation

def _divisors_near(n: int, target: int) -> list[int]:
    """The three divisors of n nearest to target, by a bounded search outward from it (n may be huge)."""
    found = {1, n} | {d for step in range(10_000) for d in (target - step, target + step) if 0 < d <= n and n % d == 0}
    return sorted(found, key=lambda d: abs(d - target))[:3]


def validate(recipe: Recipe) -> None:
    """Cross-field rules, above all the batch algebra; every message names the key and the fix."""
    samples = recipe.samples_per_step
    spos = recipe.train.samples_per_optimizer_step
    if spos is not None and spos > samples:
        raise UserError("train.samples_per_optimizer_step", f"{spos} is more than the {samples} samples per step",
                        f"use at most {samples}")
    if spos is not None and samples % spos:
        near = _divisors_near(samples, spos)
        raise UserError("train.samples_per_optimizer_step",
                        f"{spos} does not divide the samples per step {samples} (= prompts_per_step "
                        f"{recipe.rollout.prompts_per_step} x group_size {recipe.rollout.group_size})",
                        f"use a divisor such as {', '.join(map(str, sorted(near)))}, or null for all {samples}")
    cap = recipe.train.max_tokens_per_micro_batch
    longest = recipe.data.max_prompt_tokens + recipe.max_response_tokens
    budget = "rollout.max_total_tokens" if recipe.rollout.engine == "agent" else "rollout.max_new_tokens"
    if cap is not None and cap < longest:
        raise UserError("train.max_tokens_per_micro_batch", f"{cap} is less than the longest possible sequence "
                        f"{longest} (data.max_prompt_tokens {recipe.data.max_prompt_tokens} + {budget} "
                        f"{recipe.max_response_tokens})", f"raise it to at least {longest}, or lower those limits")
    r = recipe.rollout
    if r.engine == "agent" and r.env is None:
        raise UserError("rollout.env", 'is needed with rollout.engine "agent"', 'e.g. "calculator"')
    if r.engine != "agent" and (r.env is not None or r.env_options):
        raise UserError("rollout.env", f'only applies to rollout.engine "agent" (engine is "{r.engine}")',
                        'set rollout.engine to "agent", or remove rollout.env')
    _validate_vllm(recipe)
    m = recipe.model
    tp = recipe.train.tensor_parallel_size
    if tp > 1 and m.lora_rank is not None:
        raise UserError("train.tensor_parallel_size", f"{tp} with model.lora_rank: AutoTP would split the layers "
                        "peft wraps, and adapters on split layers cannot be merged for the rollout engine",
                        "train LoRA with tensor_parallel_size 1 (ZeRO-3 already partitions the base)")
    _validate_sequence_parallel(recipe)
    if tp > 1 and m.path == "builtin:tiny" and m.tiny_num_heads % tp:
        raise UserError("train.tensor_parallel_size", f"{tp} does not divide model.tiny_num_heads "
                        f"{m.tiny_num_heads}: each rank must hold whole attention heads",
                        f"use a divisor of {m.tiny_num_heads}")
    if m.path == "builtin:tiny" and m.tiny_hidden_size % m.tiny_num_heads:
        raise UserError("model.tiny_num_heads", f"{m.tiny_num_heads} does not divide tiny_hidden_size "
                        f"{m.tiny_hidden_size}", "pick a divisor, e.g. 4")
    targets = m.lora_target_modules
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise UserError("model.lora_target_modules", f"{targets} must be a non-empty list of module names",
                        '["all-linear"], or e.g. ["q_proj", "k_proj", "v_proj", "o_proj"]')
    betas = recipe.train.adam_betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                  for b in betas):
        raise UserError("train.adam_betas", f"{betas} is not two numbers in [0, 1)", "e.g. [0.9, 0.999]")
    a = recipe.algorithm
    _validate_algorithm(recipe)
    _validate_eval(recipe.eval)
    _validate_profiling(recipe)
    if a.advantage == "dr_grpo" and a.scale_rewards not in (None, "none"):
        raise UserError("algorithm.scale_rewards", f'"{a.scale_rewards}" contradicts advantage "dr_grpo", which is '
                        "defined by not scaling the centred rewards", 'use advantage "grpo" to scale, or null')
    _validate_reward_specs(recipe.reward.functions, scored_by_env=recipe.rollout.engine == "agent")


def _validate_sequence_parallel(recipe: Recipe) -> None:
    """What Ulysses sequence parallelism (grpo_ds.model.sequence_parallel) cannot take, refused with the reason."""
    sp, t, m = recipe.train.sequence_parallel_size, recipe.train, recipe.model
    if sp == 1:
        return
    where = "train.sequence_parallel_size"
    if t.tensor_parallel_size > 1:
        raise UserError(where, f"{sp} with train.tensor_parallel_size {t.tensor_parallel_size}: the two cannot be "
                        "combined yet", "use one of them")
    if t.max_tokens_per_micro_batch is not None:
        raise UserError(where, f"{sp} with train.max_tokens_per_micro_batch: Ulysses needs the same number of rows "
                        "in every micro-batch", "set train.max_tokens_per_micro_batch to null")
    if recipe.algorithm.policy_loss == "gspo":
        raise UserError(where, f"{sp} with policy_loss \"gspo\": a sequence's ratio needs all of its tokens on one "
                        "rank", 'use policy_loss "ppo_clip" or sequence_parallel_size 1')
    if m.path == "builtin:tiny" and m.tiny_num_heads % sp:
        raise UserError(where, f"{sp} does not divide model.tiny_num_heads {m.tiny_num_heads}: each rank attends "
                        "with whole heads", f"use a divisor of {m.tiny_num_heads}")


def _validate_vllm(recipe: Recipe) -> None:
    """rollout.vllm_max_model_len must hold the longest sequence. The vllm_* keys are ignored by the other engines
    (so one recipe can compare engines with a rollout.engine override); the tensor-parallel size is checked against
    the world size at start-up (grpo_ds.rollout.vllm.check_vllm_setup)."""
    r = recipe.rollout
    longest = recipe.data.max_prompt_tokens + r.max_new_tokens
    if r.engine == "vllm" and r.vllm_max_model_len is not None and r.vllm_max_model_len < longest:
        raise UserError("rollout.vllm_max_model_len", f"{r.vllm_max_model_len} is less than the longest sequence "
                        f"{longest} (data.max_prompt_tokens {recipe.data.max_prompt_tokens} + rollout.max_new_tokens "
                        f"{r.max_new_tokens})", f"raise it to at least {longest}, or null")


def _validate_eval(e: EvalConfig) -> None:
    ks = e.pass_at
    if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= e.samples_per_prompt
                         for k in ks):
        raise UserError("eval.pass_at", f"{ks} must be a non-empty list of whole numbers from 1 to "
                        f"eval.samples_per_prompt {e.samples_per_prompt}", f"e.g. [1, {e.samples_per_prompt}]")


PROFILE_MAX_STEPS = 10  # a trace holds every operator of every step: MBs per step even for builtin:tiny


def _validate_profiling(recipe: Recipe) -> None:
    steps, last_step = recipe.logging.profile_steps, recipe.train.steps
    example = f"e.g. [{min(2, last_step)}, {min(3, last_step)}]"
    if steps is None:
        if recipe.logging.profile_comms:
            raise UserError("logging.profile_comms", "logs the profiled steps, but logging.profile_steps is null",
                            f"set logging.profile_steps too, {example}")
        return
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise UserError("logging.profile_steps", f"{json.dumps(steps)} is not [first, last], two step numbers",
                        example)
    first, last = steps
    if first < 1 or first > last:
        raise UserError("logging.profile_steps", f"{steps} must have 1 <= first <= last (steps count from 1)",
                        f"e.g. [{max(1, min(first, last))}, {max(1, first, last)}]")
    if last > last_step:
        raise UserError("logging.profile_steps", f"{steps} ends after the run's last step (train.steps {last_step})",
                        example if first > last_step else f"e.g. [{first}, {min(first + 1, last_step)}]")
    if last - first + 1 > PROFILE_MAX_STEPS:
        raise UserError("logging.profile_steps", f"{steps} is {last - first + 1} steps; at most {PROFILE_MAX_STEPS} "
                        "(a trace holds every operator of every step it covers)",
                        f"e.g. [{first}, {first + 1}]: a few steps show where the time goes")


def _validate_algorithm(recipe: Recipe) -> None:
    a = recipe.algorithm
    if a.policy_loss == "gspo" and a.loss_agg != "seq-mean-token-mean":
        raise UserError("algorithm.loss_agg", f'"{a.loss_agg}" with policy_loss "gspo": GSPO is defined as the mean '
                        "over sequences of length-normalised sequence terms", 'set it to "seq-mean-token-mean"')
    if a.policy_loss == "gspo" and a.dual_clip is not None:
        raise UserError("algorithm.dual_clip", 'is a token-level clip and does not apply to policy_loss "gspo"',
                        "set it to null")
    if a.kl_in_reward and a.kl_coef == 0:
        raise UserError("algorithm.kl_in_reward", "is true but kl_coef is 0, so there is no KL to subtract",
                        "set algorithm.kl_coef > 0, or kl_in_reward to false")
    buffer, limit = a.overlong_buffer_tokens, recipe.max_response_tokens
    if buffer is not None and buffer >= limit:
        raise UserError("algorithm.overlong_buffer_tokens", f"{buffer} is not less than the response limit {limit}",
                        f"use at most {limit - 1}")


def _validate_reward_specs(functions: list, scored_by_env: bool) -> None:
    if not functions and not scored_by_env:
        raise UserError("reward.functions", "is empty", 'add one, e.g. [{"name": "exact_match", "weight": 1.0}]')
    parse_reward_specs(functions)  # each entry's keys, types and default weight, as loading reads them
