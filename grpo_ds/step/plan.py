"""The micro-batch planner: pure functions, no torch.distributed.

One step's samples (P x G completions) are split into

    optimizer-step mini-batches  (samples_per_optimizer_step each, reshuffled every epoch)
      -> per-rank shards         (balanced by token count; any sample count works with any world
        size) -> micro-batches         (a sample count, or a cap on padded tokens = samples x
                                       longest sequence)

Every rank runs the same number of micro-batches in every mini-batch, because ZeRO-3 gathers
parameters collectively in each forward and backward: a rank with fewer real micro-batches is given
padding micro-batches (``()``), which the driver runs on a dummy sequence with loss weight 0.
"Only support equal chunk" is never the user's problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpo_ds.config.recipe import Recipe
from grpo_ds.model.batching import MicroBatch, pack_micro_batches


@dataclass(frozen=True)
class MiniBatchPlan:
    """One optimizer step: ``micro_batches[rank][i]`` are the sample ids of rank's i-th
    micro-batch."""

    sample_ids: tuple[int, ...]
    micro_batches: tuple[tuple[MicroBatch, ...], ...]

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.micro_batches[0])

    def padding_micro_batches(self) -> int:
        return sum(1 for rank in self.micro_batches for mb in rank if not mb)


def split_minibatches(
    num_samples: int, samples_per_minibatch: int, epochs: int, seed: int
) -> list[list[int]]:
    """Each epoch is a seeded permutation of the samples cut into equal mini-batches (size divides
    exactly)."""
    if num_samples % samples_per_minibatch:
        raise ValueError(f"{samples_per_minibatch} does not divide {num_samples}")
    out: list[list[int]] = []
    for epoch in range(epochs):
        order = (
            list(range(num_samples))
            if epochs == 1 and samples_per_minibatch == num_samples
            else np.random.default_rng([seed, epoch]).permutation(num_samples).tolist()
        )
        out += [
            sorted(order[i : i + samples_per_minibatch])
            for i in range(0, num_samples, samples_per_minibatch)
        ]
    return out


def shard_by_tokens(
    sample_ids: list[int], tokens: dict[int, int], world_size: int, balance_counts: bool = False
) -> list[list[int]]:
    """Greedy longest-first: each sample goes to the rank with the fewest tokens (that still has
    room).

    With ``balance_counts`` every rank gets floor(n / world) or ceil(n / world) samples, which keeps
    the number of fixed-size micro-batches per rank minimal; the token greedy decides which ranks
    get the extra.
    """
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    base, extra = divmod(len(sample_ids), world_size)

    def has_room(r: int) -> bool:
        if not balance_counts or len(shards[r]) < base:
            return True
        above_base = sum(1 for s in shards if len(s) > base)
        return len(shards[r]) == base and above_base < extra

    for sid in sorted(sample_ids, key=lambda s: (-tokens[s], s)):
        rank = min(
            (r for r in range(world_size) if has_room(r)),
            key=lambda r: (load[r], len(shards[r]), r),
        )
        shards[rank].append(sid)
        load[rank] += tokens[sid]
    return [sorted(s, key=lambda x: (-tokens[x], x)) for s in shards]


def plan_minibatch(
    sample_ids: list[int],
    tokens: dict[int, int],
    world_size: int,
    *,
    max_samples: int | None = None,
    max_tokens: int | None = None,
    packed: bool = False,
) -> MiniBatchPlan:
    """Shard one mini-batch over ranks and cut each shard into micro-batches; pad to equal
    counts."""
    shards = shard_by_tokens(sample_ids, tokens, world_size, balance_counts=max_tokens is None)
    per_rank = [
        pack_micro_batches(s, tokens, max_samples=max_samples, max_tokens=max_tokens, packed=packed)
        for s in shards
    ]
    count = max(1, max(len(m) for m in per_rank))
    padded = tuple(tuple(m) + ((),) * (count - len(m)) for m in per_rank)
    return MiniBatchPlan(sample_ids=tuple(sorted(sample_ids)), micro_batches=padded)


@dataclass(frozen=True)
class StepPlan:
    """All of one step's work: the update mini-batches, and one pass for old/ref log-probs."""

    minibatches: tuple[MiniBatchPlan, ...]
    logprob_pass: MiniBatchPlan  # every sample once, with the log-prob phase's own micro size
    old_logprob_pass: bool  # whether the old-log-prob pass runs (``old_logprob_pass_reason``)


def plan_step(
    tokens: list[int],
    world_size: int,
    *,
    samples_per_minibatch: int,
    epochs: int,
    update_micro_samples: int,
    logprob_micro_samples: int,
    max_tokens: int | None,
    seed: int,
    old_logprob_pass: bool,
    packed: bool = False,
) -> StepPlan:
    """Plan one step for samples ``0..len(tokens)-1`` whose sequence lengths are ``tokens``."""
    token_map = dict(enumerate(tokens))
    groups = split_minibatches(len(tokens), samples_per_minibatch, epochs, seed)
    minibatches = tuple(
        plan_minibatch(
            ids,
            token_map,
            world_size,
            max_samples=update_micro_samples,
            max_tokens=max_tokens,
            packed=packed,
        )
        for ids in groups
    )
    logprob_pass = plan_minibatch(
        list(range(len(tokens))),
        token_map,
        world_size,
        max_samples=logprob_micro_samples,
        max_tokens=max_tokens,
        packed=packed,
    )
    return StepPlan(
        minibatches=minibatches, logprob_pass=logprob_pass, old_logprob_pass=old_logprob_pass
    )


def plan_recipe_step(
    recipe: Recipe, tokens: list[int], world_size: int, step: int, packed: bool | None = None
) -> StepPlan:
    """``plan_step`` with the recipe's batch settings for step ``step`` (the driver and the dry
    run). ``packed``: the layout the run uses (train.packing unless the model cannot pack, which the
    policy finds out when built)."""
    t = recipe.train
    return plan_step(
        tokens,
        world_size,
        samples_per_minibatch=recipe.samples_per_optimizer_step,
        epochs=t.epochs_per_rollout,
        update_micro_samples=t.micro_batch_samples_per_gpu,
        logprob_micro_samples=t.logprob_micro_batch_samples_per_gpu,
        max_tokens=t.max_tokens_per_micro_batch,
        seed=recipe.run.seed * 7919 + step,
        old_logprob_pass=old_logprob_pass_reason(recipe) is not None,
        packed=t.packing if packed is None else packed,
    )


def old_logprob_pass_reason(recipe: Recipe) -> str | None:
    """Why the step scores its samples under the policy before updating it (None: it does not).

    The old log-probs pi_old are needed when the policy changes before a sample is trained on (more
    than one optimizer step per rollout); with one optimizer step they equal the current ones,
    detached. Importance weights (pi_old / pi_sampler) and KL in the reward need them at sampling
    time in any case.
    """
    if recipe.optimizer_steps_per_rollout > 1:
        return (
            "the policy changes within a rollout "
            f"({recipe.optimizer_steps_per_rollout} optimizer steps)"
        )
    a = recipe.algorithm
    if a.rollout_is_cap is not None:
        return (
            "importance weights (algorithm.rollout_is_cap) "
            "need the policy's log-probs at sampling time"
        )
    if a.kl_in_reward:
        return (
            "the KL in the reward (algorithm.kl_in_reward) "
            "needs the policy's log-probs at sampling time"
        )
    return None


def token_imbalance(plan: MiniBatchPlan, tokens: list[int] | dict[int, int]) -> float:
    """max / mean of real tokens per rank (1.0 = perfectly balanced)."""
    per_rank = [sum(tokens[s] for mb in rank for s in mb) for rank in plan.micro_batches]
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
