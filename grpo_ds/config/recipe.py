"""The recipe's schema: frozen dataclasses, one field per key.

This module holds the ``Recipe``, which composes the sections, and the run, model, data, eval,
checkpoint and logging sections; the rollout and reward sections are declared in
``grpo_ds.config.recipe_rollout``, the algorithm, train and kernels sections in
``grpo_ds.config.recipe_training``. Every default lives in these three modules and nowhere else.
Each field declares its documentation, and where it applies its allowed choices and numeric range,
with ``opt`` (grpo_ds.config.options); validation, ``grpo_ds.check`` and the docs' key reference
(docs/reference/recipe.md, generated) all read that one declaration.

The schema knows nothing of loading or of its cross-key rules: grpo_ds.config.loading.load_recipe
reads a recipe into it and then runs the rules (grpo_ds.config.rules).
The DeepSpeed side (``train_batch_size`` and friends) is resolved in ``grpo_ds.config.deepspeed``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from grpo_ds.algo.names import ESTIMATORS
from grpo_ds.config.dtypes import DTYPES
from grpo_ds.config.options import opt
from grpo_ds.config.recipe_rollout import RewardConfig, RolloutConfig
from grpo_ds.config.recipe_training import AlgorithmConfig, KernelsConfig, TrainConfig


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
        "builtin:tiny",
        '"builtin:tiny" (random tiny model, no download), a local HF model folder, or a Hugging '
        'Face Hub id "owner/name" (where no local path has that name), fetched into the Hugging '
        "Face cache once per node (docs/guides/recipes.md)",
    )
    revision: str | None = opt(
        None,
        "Hub id only: the branch, tag or commit of model.path to train (null = the "
        "repository's default branch)",
        example="main",
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
        '"builtin:arith", a .jsonl/.json/.parquet file, a saved HF dataset folder, or a Hugging '
        'Face Hub dataset id "owner/name" (where no local path has that name), fetched into the '
        "Hugging Face cache once per node",
    )
    train_config: str | None = opt(
        None,
        "Hub dataset only: the configuration (subset) of data.train to read, e.g. "
        '"main" for openai/gsm8k (null = its only or default one)',
        example="main",
    )
    train_split: str = opt("train", "Hub dataset only: the split of data.train to read")
    train_revision: str | None = opt(
        None,
        "Hub dataset only: the branch, tag or commit of data.train (null = the default branch)",
        example="main",
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
class EvalConfig:
    data: str | None = opt(
        None,
        "Held-out prompts scored during training, same formats (a Hub id too) and columns as "
        "data.train (null = no evaluation)",
    )
    data_config: str | None = opt(
        None,
        "Hub dataset only: the configuration (subset) of eval.data (null = its only or "
        "default one)",
        example="main",
    )
    data_split: str = opt("test", "Hub dataset only: the split of eval.data to read")
    data_revision: str | None = opt(
        None,
        "Hub dataset only: the branch, tag or commit of eval.data (null = the default branch)",
        example="main",
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
    # the Hub id model.path named before the preflight replaced it by the id's folder in the Hugging
    # Face cache (grpo_ds.run.hub): the run reads the folder, to_dict writes the id
    model_hub_id: str | None = field(default=None, compare=False, metadata={"internal": True})

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
        """The recipe as the user wrote it, defaults applied (the run folder's recipe.json): a Hub
        id in model.path stays the id, not the cache folder the run reads."""
        out = dataclasses.asdict(self)
        out.pop("source_dir")
        hub_id = out.pop("model_hub_id")
        if hub_id is not None:
            out["model"]["path"] = hub_id
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
