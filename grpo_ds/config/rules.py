"""The recipe's cross-key rules, above all the batch algebra: what no single key's type, choices and
range can say.

``validate`` runs when a recipe is loaded (grpo_ds.config.loading.load_recipe), after every key was
checked on its own; each message names the key and the fix. The schema is imported for type hints
only; it knows nothing of these rules.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from grpo_ds.config.reward_specs import reward_specs
from grpo_ds.errors import UserError

if TYPE_CHECKING:
    from grpo_ds.config.recipe import EvalConfig, Recipe


def _divisors_near(n: int, target: int) -> list[int]:
    """The three divisors of n nearest to target, by a bounded search outward from it (n may be
    huge)."""
    found = {1, n} | {
        d
        for step in range(10_000)
        for d in (target - step, target + step)
        if 0 < d <= n and n % d == 0
    }
    return sorted(found, key=lambda d: abs(d - target))[:3]


def validate(recipe: Recipe) -> None:
    """Cross-field rules, above all the batch algebra; every message names the key and the fix. The
    rules run in this order, so that a recipe that breaks several hears of the first."""
    _validate_batch(recipe)
    _validate_env(recipe)
    _validate_vllm(recipe)
    _validate_tensor_parallel(recipe)
    _validate_sequence_parallel(recipe)
    _validate_tiny_model(recipe)
    _validate_model_and_optimizer(recipe)
    _validate_algorithm(recipe)
    _validate_eval(recipe.eval)
    _validate_profiling(recipe)
    _validate_scale_rewards(recipe)
    _validate_rewards(recipe)


def _validate_batch(recipe: Recipe) -> None:
    """The batch algebra: an optimizer step's samples divide the step's, and a micro-batch's token
    cap holds the longest possible sequence."""
    samples = recipe.samples_per_step
    spos = recipe.train.samples_per_optimizer_step
    if spos is not None and spos > samples:
        raise UserError(
            "train.samples_per_optimizer_step",
            f"{spos} is more than the {samples} samples per step",
            f"use at most {samples}",
        )
    if spos is not None and samples % spos:
        near = _divisors_near(samples, spos)
        raise UserError(
            "train.samples_per_optimizer_step",
            f"{spos} does not divide the samples per step {samples} (= prompts_per_step "
            f"{recipe.rollout.prompts_per_step} x group_size {recipe.rollout.group_size})",
            f"use a divisor such as {', '.join(map(str, sorted(near)))}, or null for all {samples}",
        )
    cap = recipe.train.max_tokens_per_micro_batch
    longest = recipe.data.max_prompt_tokens + recipe.max_response_tokens
    budget = (
        "rollout.max_total_tokens" if recipe.rollout.engine == "agent" else "rollout.max_new_tokens"
    )
    if cap is not None and cap < longest:
        raise UserError(
            "train.max_tokens_per_micro_batch",
            f"{cap} is less than the longest possible sequence "
            f"{longest} (data.max_prompt_tokens {recipe.data.max_prompt_tokens} + {budget} "
            f"{recipe.max_response_tokens})",
            f"raise it to at least {longest}, or lower those limits",
        )


def _validate_env(recipe: Recipe) -> None:
    """rollout.env: needed by the agent engine, and only by it."""
    r = recipe.rollout
    if r.engine == "agent" and r.env is None:
        raise UserError("rollout.env", 'is needed with rollout.engine "agent"', 'e.g. "calculator"')
    if r.engine != "agent" and (r.env is not None or r.env_options):
        raise UserError(
            "rollout.env",
            f'only applies to rollout.engine "agent" (engine is "{r.engine}")',
            'set rollout.engine to "agent", or remove rollout.env',
        )


def _validate_tensor_parallel(recipe: Recipe) -> None:
    """What AutoTP tensor parallelism cannot take yet: LoRA adapters, reward models."""
    tp = recipe.train.tensor_parallel_size
    if tp > 1 and recipe.model.lora_rank is not None:
        raise UserError(
            "train.tensor_parallel_size",
            f"{tp} with model.lora_rank: AutoTP would split the layers "
            "peft wraps, and adapters on split layers cannot be merged for the rollout engine",
            "train LoRA with tensor_parallel_size 1 (ZeRO-3 already partitions the base)",
        )
    if tp > 1 and recipe.reward.models:
        raise UserError(
            "train.tensor_parallel_size",
            f"{tp} with reward.models: a reward model does not follow the "
            "policy's tensor-parallel layout (AutoTP) yet; it would need the policy's "
            "tensor-parallel groups",
            "train with tensor_parallel_size 1 (ZeRO-3 partitions the reward model too), or "
            "score with reward.functions",
        )


def _validate_tiny_model(recipe: Recipe) -> None:
    """builtin:tiny's shape: whole heads on each tensor-parallel rank and in the hidden size, at
    most as many experts per token as there are experts."""
    m, tp = recipe.model, recipe.train.tensor_parallel_size
    if tp > 1 and m.path == "builtin:tiny" and m.tiny_num_heads % tp:
        raise UserError(
            "train.tensor_parallel_size",
            f"{tp} does not divide model.tiny_num_heads "
            f"{m.tiny_num_heads}: each rank must hold whole attention heads",
            f"use a divisor of {m.tiny_num_heads}",
        )
    if m.path == "builtin:tiny" and m.tiny_hidden_size % m.tiny_num_heads:
        raise UserError(
            "model.tiny_num_heads",
            f"{m.tiny_num_heads} does not divide tiny_hidden_size {m.tiny_hidden_size}",
            "pick a divisor, e.g. 4",
        )
    if (
        m.path == "builtin:tiny"
        and m.tiny_num_experts
        and m.tiny_experts_per_token > m.tiny_num_experts
    ):
        raise UserError(
            "model.tiny_experts_per_token",
            f"{m.tiny_experts_per_token} is more than tiny_num_experts {m.tiny_num_experts}",
            f"route each token to at most {m.tiny_num_experts} experts",
        )


def _validate_model_and_optimizer(recipe: Recipe) -> None:
    """The list values no single key's type can check (LoRA's target modules, Adam's betas), and
    lean bf16's need for a bf16 model."""
    m = recipe.model
    targets = m.lora_target_modules
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise UserError(
            "model.lora_target_modules",
            f"{targets} must be a non-empty list of module names",
            '["all-linear"], or e.g. ["q_proj", "k_proj", "v_proj", "o_proj"]',
        )
    betas = recipe.train.adam_betas
    if len(betas) != 2 or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
    ):
        raise UserError(
            "train.adam_betas", f"{betas} is not two numbers in [0, 1)", "e.g. [0.9, 0.999]"
        )
    if recipe.train.lean_bf16 and m.dtype != "bfloat16":
        raise UserError(
            "train.lean_bf16",
            f'keeps bf16 master weights, so it needs model.dtype "bfloat16" (it is "{m.dtype}")',
            'set model.dtype to "bfloat16", or train.lean_bf16 to false',
        )


def _validate_scale_rewards(recipe: Recipe) -> None:
    a = recipe.algorithm
    if a.advantage == "dr_grpo" and a.scale_rewards not in (None, "none"):
        raise UserError(
            "algorithm.scale_rewards",
            f'"{a.scale_rewards}" contradicts advantage "dr_grpo", which is '
            "defined by not scaling the centred rewards",
            'use advantage "grpo" to scale, or null',
        )


def _validate_sequence_parallel(recipe: Recipe) -> None:
    """What Ulysses sequence parallelism (grpo_ds.model.sequence_parallel) cannot take, refused with
    the reason."""
    sp, t, m = recipe.train.sequence_parallel_size, recipe.train, recipe.model
    if sp == 1:
        return
    where = "train.sequence_parallel_size"
    if t.tensor_parallel_size > 1:
        raise UserError(
            where,
            f"{sp} with train.tensor_parallel_size {t.tensor_parallel_size}: the two cannot be "
            "combined yet",
            "use one of them",
        )
    if t.max_tokens_per_micro_batch is not None:
        raise UserError(
            where,
            f"{sp} with train.max_tokens_per_micro_batch: Ulysses needs the same number of rows "
            "in every micro-batch",
            "set train.max_tokens_per_micro_batch to null",
        )
    if recipe.algorithm.policy_loss == "gspo":
        raise UserError(
            where,
            f'{sp} with policy_loss "gspo": a sequence\'s ratio needs all of its tokens on one '
            "rank",
            'use policy_loss "ppo_clip" or sequence_parallel_size 1',
        )
    if m.path == "builtin:tiny" and m.tiny_num_heads % sp:
        raise UserError(
            where,
            f"{sp} does not divide model.tiny_num_heads {m.tiny_num_heads}: each rank attends "
            "with whole heads",
            f"use a divisor of {m.tiny_num_heads}",
        )


def _validate_vllm(recipe: Recipe) -> None:
    """rollout.vllm_max_model_len must hold the longest sequence, and vllm_max_num_batched_tokens
    as many tokens as vllm_max_num_seqs has sequences (where both are set). The vllm_* keys are
    ignored by the other engines (so one recipe can compare engines with a rollout.engine
    override); the tensor-parallel size is checked against the world size at start-up
    (grpo_ds.rollout.vllm_checks.check_vllm_setup)."""
    r = recipe.rollout
    longest = recipe.data.max_prompt_tokens + r.max_new_tokens
    if recipe.uses_vllm and r.vllm_max_model_len is not None and r.vllm_max_model_len < longest:
        raise UserError(
            "rollout.vllm_max_model_len",
            f"{r.vllm_max_model_len} is less than the longest sequence "
            f"{longest} (data.max_prompt_tokens {recipe.data.max_prompt_tokens} + "
            f"rollout.max_new_tokens {r.max_new_tokens})",
            f"raise it to at least {longest}, or null",
        )
    seqs, tokens = r.vllm_max_num_seqs, r.vllm_max_num_batched_tokens
    if recipe.uses_vllm and seqs is not None and tokens is not None and tokens < seqs:
        raise UserError(  # vLLM's own rule, which it would say once the model had loaded
            "rollout.vllm_max_num_batched_tokens",
            f"{tokens} is less than rollout.vllm_max_num_seqs {seqs}: vLLM computes at least one "
            "token of every sequence it schedules in an engine step",
            f"raise it to at least {seqs}, or lower vllm_max_num_seqs",
        )


def _validate_eval(e: EvalConfig) -> None:
    ks = e.pass_at
    if not ks or not all(
        isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= e.samples_per_prompt
        for k in ks
    ):
        raise UserError(
            "eval.pass_at",
            f"{ks} must be a non-empty list of whole numbers from 1 to "
            f"eval.samples_per_prompt {e.samples_per_prompt}",
            f"e.g. [1, {e.samples_per_prompt}]",
        )


# A trace holds every operator of every step: MBs per step even for builtin:tiny. The memory
# timeline alone is small (step/memory_timeline.py), so a range without the trace has no cap.
PROFILE_MAX_STEPS = 10


def _validate_profiling(recipe: Recipe) -> None:
    steps, last_step = recipe.logging.profile_steps, recipe.train.steps
    example = f"e.g. [{min(2, last_step)}, {min(3, last_step)}]"
    if steps is None:
        if recipe.logging.profile_comms:
            raise UserError(
                "logging.profile_comms",
                "logs the profiled steps, but logging.profile_steps is null",
                f"set logging.profile_steps too, {example}",
            )
        return
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise UserError(
            "logging.profile_steps",
            f"{json.dumps(steps)} is not [first, last], two step numbers",
            example,
        )
    first, last = steps
    if first < 1 or first > last:
        raise UserError(
            "logging.profile_steps",
            f"{steps} must have 1 <= first <= last (steps count from 1)",
            f"e.g. [{max(1, min(first, last))}, {max(1, first, last)}]",
        )
    if last > last_step:
        raise UserError(
            "logging.profile_steps",
            f"{steps} ends after the run's last step (train.steps {last_step})",
            example if first > last_step else f"e.g. [{first}, {min(first + 1, last_step)}]",
        )
    if recipe.logging.profile_trace and last - first + 1 > PROFILE_MAX_STEPS:
        raise UserError(
            "logging.profile_steps",
            f"{steps} is {last - first + 1} steps; at most {PROFILE_MAX_STEPS} "
            "with logging.profile_trace (a trace holds every operator of every step it covers)",
            f"e.g. [{first}, {first + 1}]: a few steps show where the time goes, or "
            "logging.profile_trace=false for the memory timeline alone over any range",
        )


def _validate_algorithm(recipe: Recipe) -> None:
    a = recipe.algorithm
    if a.policy_loss == "gspo" and a.loss_agg != "seq-mean-token-mean":
        raise UserError(
            "algorithm.loss_agg",
            f'"{a.loss_agg}" with policy_loss "gspo": GSPO is defined as the mean '
            "over sequences of length-normalised sequence terms",
            'set it to "seq-mean-token-mean"',
        )
    if a.policy_loss == "gspo" and a.dual_clip is not None:
        raise UserError(
            "algorithm.dual_clip",
            'is a token-level clip and does not apply to policy_loss "gspo"',
            "set it to null",
        )
    if a.kl_in_reward and a.kl_coef == 0:
        raise UserError(
            "algorithm.kl_in_reward",
            "is true but kl_coef is 0, so there is no KL to subtract",
            "set algorithm.kl_coef > 0, or kl_in_reward to false",
        )
    buffer, limit = a.overlong_buffer_tokens, recipe.max_response_tokens
    if buffer is not None and buffer >= limit:
        raise UserError(
            "algorithm.overlong_buffer_tokens",
            f"{buffer} is not less than the response limit {limit}",
            f"use at most {limit - 1}",
        )


def _validate_rewards(recipe: Recipe) -> None:
    """Each reward entry (parsed here, once: grpo_ds.config.reward_specs), and something to score
    the samples: a reward function, a reward model, or the agent engine's environment."""
    rewards = reward_specs(recipe.reward)
    if not rewards.functions and not rewards.models and recipe.rollout.engine != "agent":
        raise UserError(
            "reward.functions", "is empty", 'add one, e.g. [{"name": "exact_match", "weight": 1.0}]'
        )
