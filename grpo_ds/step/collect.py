"""One step's training samples: rollout, reward, and DAPO's dynamic sampling.

Rank 0 picks the prompts; every rank generates a contiguous slice of them and all ranks receive the whole batch. A
sample is drawn with the step's seed and its place in the batch (``SamplingParams.first_prompt``), so a step draws
the same samples at any world size and a run can move to another one (grpo_ds.run.universal). Rank 0 scores the
batch (reward functions plus environment rewards) and sends the rewards to every rank. Without dynamic sampling that
is one round. With it (DAPO, Yu et al. 2025, arXiv:2503.14476), a group whose G rewards are all equal has zero
advantage under every group baseline and teaches nothing, so it is dropped and another round of prompts_per_step
prompts is drawn, until prompts_per_step informative groups are collected or ``dynamic_sampling_max_rounds`` extra
rounds are spent; then the step is topped up with equal-reward groups (which contribute no gradient) so the batch
algebra stays exact. Reward metrics describe every sample drawn in the step; ``no_signal_frac`` is the fraction of
the trained groups whose rewards are all equal (with dynamic sampling: the topped-up ones).
"""

from __future__ import annotations

from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import Dist
from grpo_ds.rewards import RewardResult, score
from grpo_ds.rewards.scoring import add_model_scores
from grpo_ds.rollout.base import RolloutEngine, Rollouts, SamplingParams
from grpo_ds.run.preflight import Inputs
from grpo_ds.run.prompts import PromptRow, PromptSampler
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.profiling import Phase


def collect(step: int, recipe: Recipe, inputs: Inputs, engine: RolloutEngine, sampler: PromptSampler,
            dist: Dist, reward_models=None) -> StepBatch:
    """The step's samples and rewards (plus the collection's metrics, and its "rollout", "reward_model" and "reward"
    times). ``reward_models``: the recipe's learned reward models (a grpo_ds.reward_models.scorer.RewardModels, passed
    in: this part does not import that one, which plans its micro-batches with grpo_ds.step.plan), held by every rank
    that calls this (colocated placement); None where none are held (no reward.models, or the rollout ranks of a split
    placement, whose trainer adds the models' scores: ``add_model_rewards``)."""
    P, G = recipe.rollout.prompts_per_step, recipe.rollout.group_size
    a = recipe.algorithm
    rounds = 1 + (a.dynamic_sampling_max_rounds if a.dynamic_sampling else 0)
    times, spans = {"rollout": 0.0, "reward": 0.0}, []
    drawn: list[tuple[list[int], Rollouts, list[float]]] = []  # per round: prompts, samples, rewards
    scored: list[RewardResult] = []
    model_metrics: dict = {}  # the reward models' (inputs truncated), summed over rounds
    informative: list[tuple[int, int]] = []  # (round, group) with unequal rewards
    for round_index in range(rounds):
        with Phase("rollout", times, spans):
            prompt_index = dist.broadcast(sampler.next_indices(P) if dist.is_main else None)
            lo, hi = dist.dp_slice(P)
            sampling = SamplingParams(recipe.rollout.max_new_tokens, recipe.rollout.temperature,
                                      recipe.rollout.top_p, recipe.rollout.top_k, seed=recipe.run.seed * 1_000_003
                                      + step * 1_009 + round_index * 100_003, first_prompt=lo)
            mine = prompt_index[lo:hi]
            local = engine.generate([inputs.prompts[i].prompt_ids for i in mine], G, sampling,
                                    [inputs.prompts[i].columns for i in mine])
            rollouts = Rollouts.concat(dist.dp_parts(dist.all_gather(local)))  # a TP group generated the same

        rows = [inputs.prompts[i] for i in prompt_index]
        models = score_models(reward_models, inputs, rows, rollouts, G, times, spans, model_metrics, dist)
        with Phase("reward", times, spans):
            result = dist.decide(score_rewards, recipe, inputs, rows, rollouts, G, models)
        scored.append(result)
        rewards = _with_env_rewards(result.total, rollouts)
        drawn.append((prompt_index, rollouts, rewards))
        informative += [(round_index, g) for g in range(P) if not equal_rewards(rewards[g * G:(g + 1) * G])]
        if not a.dynamic_sampling or len(informative) >= P:
            break

    if a.dynamic_sampling:
        chosen, seen = informative[:P], set(informative)
        flat = [(r, g) for r in range(len(drawn)) for g in range(P) if (r, g) not in seen]
        topped_up = flat[:P - len(chosen)]
        chosen = sorted(chosen + topped_up)
    else:
        chosen, topped_up = [(0, g) for g in range(P)], []
    samples = _select(drawn, chosen, G)
    metrics = _reward_metrics(scored, [r for _, _, rewards in drawn for r in rewards], drawn)
    metrics.update(model_metrics)
    metrics["no_signal_frac"] = no_signal_fraction(samples[2], G)
    if a.dynamic_sampling:
        metrics.update({"dynamic/rounds": len(drawn), "dynamic/prompts_drawn": P * len(drawn),
                        "dynamic/informative_groups": len(informative), "dynamic/topped_up_groups": len(topped_up)})
    return StepBatch(samples[0], samples[1], samples[2], metrics, times, spans=spans)


def equal_rewards(group: list[float]) -> bool:
    """A group whose rewards are all equal: zero advantage under every group baseline, no reward signal."""
    return len(set(group)) <= 1


def no_signal_fraction(rewards: list[float], group_size: int) -> float:
    """The fraction of the groups (consecutive runs of ``group_size`` rewards) whose rewards are all equal."""
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    return sum(equal_rewards(g) for g in groups) / len(groups)


def score_rewards(recipe: Recipe, inputs: Inputs, prompts: list[PromptRow], rollouts: Rollouts, group_size: int,
                  models: list[tuple[str, float, list[float]]] | None = None) -> RewardResult:
    """Rank 0: the reward functions' scores of ``group_size`` answers to each of ``prompts``, plus the reward models'
    (``models``: (name, weight, scores), from ``score_models``)."""
    rows = [p for p in prompts for _ in range(group_size)]
    columns = {k: [r.columns.get(k) for r in rows] for k in rows[0].columns}
    columns["answer"] = [r.columns.get(recipe.data.answer_key) for r in rows]  # what exact_match reads
    result = score(inputs.reward_functions, prompts=[r.prompt_text for r in rows],
                   completions=completion_texts(inputs, rollouts), completion_ids=rollouts.response_ids,
                   columns=columns, on_error=recipe.reward.on_error, timeout_s=recipe.reward.timeout_s,
                   chunk_samples=recipe.reward.chunk_samples, group_size=group_size, pool=inputs.reward_pool)
    return add_model_scores(result, models) if models else result


def completion_texts(inputs: Inputs, rollouts: Rollouts) -> list[str]:
    """Each sample's generated text (special tokens skipped): what reward functions and reward models read."""
    return inputs.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)


def score_models(reward_models, inputs: Inputs, prompts: list[PromptRow], rollouts: Rollouts,
                 group_size: int, times: dict, spans: list, metrics: dict, dist: Dist
                 ) -> list[tuple[str, float, list[float]]] | None:
    """Every rank: each reward model's score of every sample, as (name, weight, scores), and its metrics added into
    ``metrics``. The models read the prompt and completion as text (re-tokenized with their own tokenizers: policy
    token ids never reach them); each rank scores its share and every rank gets all scores (grpo_ds.reward_models)."""
    if reward_models is None:
        return None
    with Phase("reward_model", times, spans):
        texts = [p.prompt_text for p in prompts for _ in range(group_size)]
        scored = reward_models.score(texts, completion_texts(inputs, rollouts), dist)
    for key, value in scored.metrics.items():  # summed over a step's rounds (dynamic sampling)
        metrics[key] = metrics.get(key, 0.0) + value
    return [(m.spec.name, m.spec.weight, scored.scores[m.spec.name]) for m in reward_models.models]


def score_samples(recipe: Recipe, inputs: Inputs, prompts: list[PromptRow], rollouts: Rollouts, group_size: int,
                  models: list[tuple[str, float, list[float]]] | None = None) -> list[float]:
    """Rank 0: each answer's total reward (reward functions and models, plus environment rewards)."""
    return _with_env_rewards(score_rewards(recipe, inputs, prompts, rollouts, group_size, models).total, rollouts)


def _with_env_rewards(total: list[float], rollouts: Rollouts) -> list[float]:
    if rollouts.env_rewards is None:
        return list(total)
    return [t + e for t, e in zip(total, rollouts.env_rewards, strict=True)]


def _select(drawn: list[tuple[list[int], Rollouts, list[float]]], chosen: list[tuple[int, int]], G: int
            ) -> tuple[list[int], Rollouts, list[float]]:
    prompt_index, parts, rewards = [], [], []
    for round_index, group in chosen:
        prompts, rollouts, round_rewards = drawn[round_index]
        samples = list(range(group * G, (group + 1) * G))
        prompt_index.append(prompts[group])
        parts.append(rollouts.select(samples))
        rewards += [round_rewards[s] for s in samples]
    return prompt_index, Rollouts.concat(parts), rewards


def add_model_rewards(data: StepBatch, reward_models, recipe: Recipe, inputs: Inputs, dist: Dist
                      ) -> None:
    """Split placement, every trainer rank: the reward models' scores join the rewards the rollout ranks sent (the
    functions' and the environment's) by the colocated rule (``add_model_scores``), and the reward metrics are made
    again from the sum. (Dynamic sampling, which chooses groups by their rewards on the rollout ranks, is refused
    with reward models there.)"""
    rows = [inputs.prompts[i] for i in data.prompt_index]
    models = score_models(reward_models, inputs, rows, data.rollouts, recipe.rollout.group_size, data.times,
                          data.spans, data.metrics, dist)
    result = add_model_scores(RewardResult(total=data.rewards, per_function={}, errors={}, nones={}), models)
    data.rewards = result.total
    data.metrics.update(_reward_metrics([result], result.total, drawn=[]),  # the environment's metric came along
                        no_signal_frac=no_signal_fraction(result.total, recipe.rollout.group_size))


def _reward_metrics(scored: list[RewardResult], rewards: list[float], drawn) -> dict:
    n = len(rewards)
    mean = sum(rewards) / n
    out = {"reward_mean": mean,
           "reward_std": (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5 if n > 1 else 0.0}
    for name in scored[0].per_function:
        values = [v for result in scored for v in result.per_function[name]]
        out[f"reward/{name}"] = sum(values) / len(values)
        out[f"reward_errors/{name}"] = sum(result.errors.get(name, 0) for result in scored)
        out[f"reward_none/{name}"] = sum(result.nones.get(name, 0) for result in scored)
    env = [e for _, rollouts, _ in drawn if rollouts.env_rewards is not None for e in rollouts.env_rewards]
    if env:
        out["reward/env"] = sum(env) / len(env)
    return out
