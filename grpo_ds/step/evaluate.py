"""Evaluation on a held-out prompt set during training: greedy accuracy and pass@k.

Every ``eval.every_steps`` steps (and after the last one) each prompt of ``eval.data`` is answered
once greedily and ``eval.samples_per_prompt`` (n) times by sampling at ``eval.temperature``, by the
rollout engine (the current policy). The recipe's reward functions and reward models (plus
environment rewards) score every answer; an answer is correct when its total reward is at least
``eval.correct_at``. With c correct answers out of n, pass@k is estimated without bias as 1 - C(n -
c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
arXiv:2107.03374), averaged over prompts. Each rank answers a slice of the prompts; rank 0 scores.
Metrics: eval/greedy_accuracy, eval/greedy_reward_mean, eval/reward_mean, eval/pass@k.
"""

from __future__ import annotations

from math import comb

from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import Dist
from grpo_ds.rewards.scoring import add_model_scores
from grpo_ds.rollout.base import RolloutEngine, Rollouts, SamplingParams
from grpo_ds.run.prompts import PromptRow
from grpo_ds.step.collect import score_functions, score_models, with_env_rewards
from grpo_ds.step.context import StepContext


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def due(step: int, recipe: Recipe) -> bool:
    """Whether step ``step`` ends with an evaluation: every eval.every_steps steps and after the
    last one."""
    return step % recipe.eval.every_steps == 0 or step == recipe.train.steps


def evaluate(step: int, ctx: StepContext) -> dict:
    """Eval metrics of the current policy on ``ctx.inputs.eval_prompts``, answered by
    ``ctx.rollout`` and scored with ``ctx.reward_models`` too where the rank holds them (every rank
    returns the same dict)."""
    recipe, inputs, dist, engine = ctx.recipe, ctx.inputs, ctx.dist, ctx.rollout
    prompts = inputs.eval_prompts
    e = recipe.eval
    n = e.samples_per_prompt
    greedy = _answers(recipe, prompts, engine, dist, 1, 0.0, seed=step)
    sampled = _answers(recipe, prompts, engine, dist, n, e.temperature, seed=step)
    greedy_rewards = _rewards(ctx, prompts, greedy, 1)
    rewards = _rewards(ctx, prompts, sampled, n)
    out = {
        "eval/greedy_accuracy": sum(r >= e.correct_at for r in greedy_rewards) / len(prompts),
        "eval/greedy_reward_mean": sum(greedy_rewards) / len(prompts),
        "eval/reward_mean": sum(rewards) / len(rewards),
    }
    correct = [
        sum(r >= e.correct_at for r in rewards[i * n : (i + 1) * n]) for i in range(len(prompts))
    ]
    for k in e.pass_at:
        out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(prompts)
    return out


def _rewards(
    ctx: StepContext, prompts: list[PromptRow], answers: Rollouts, group_size: int
) -> list[float]:
    """Each answer's total reward, on every rank: the reward models' scores (where the rank holds
    them), plus the reward functions' (rank 0's, sent to every rank), plus the environment's."""
    unused: dict = {}  # their time is the eval phase's; their metrics describe the training batch
    models = score_models(ctx, prompts, answers, group_size, unused, [], unused)
    functions = ctx.dist.decide(score_functions, ctx.inputs, prompts, answers, group_size)
    return with_env_rewards(add_model_scores(functions, models).total, answers)


def _answers(
    recipe: Recipe,
    prompts: list[PromptRow],
    engine: RolloutEngine,
    dist: Dist,
    group_size: int,
    temperature: float,
    seed: int,
) -> Rollouts:
    lo, hi = dist.dp_slice(len(prompts))
    sampling = SamplingParams(
        recipe.rollout.max_new_tokens,
        temperature,
        recipe.rollout.top_p,
        recipe.rollout.top_k,
        seed=recipe.run.seed * 7_777 + seed * 31,
        first_prompt=lo,
    )
    mine = prompts[lo:hi]
    local = engine.generate(
        [p.prompt_ids for p in mine], group_size, sampling, [p.columns for p in mine]
    )
    return Rollouts.concat(dist.dp_parts(dist.all_gather(local)))
