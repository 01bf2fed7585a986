"""The recipe's ``algorithm``, ``train`` and ``kernels`` sections: the objective, the update and its
batch sizes, and the backend of the per-token math.

Part of the recipe's schema (grpo_ds.config.recipe composes the sections into the ``Recipe``): each
key declared with ``opt`` (grpo_ds.config.options), its default written here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_ds.algo.names import ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, SCALES
from grpo_ds.config.options import opt


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
