"""The two training-side phases of a step: log-prob passes and the policy update.

``logprob_pass`` scores every sample under an engine's current weights (old policy, or the frozen
reference) with the log-prob phase's own micro-batches. ``optimizer_step`` runs one rank's
micro-batches of one mini-batch through the loss (grpo_ds.step.loss, which states the loss
contract), backward, and one optimizer step. The per-token weights of the loss are built here, on
the whole global mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_ds.algo.aggregation import sequence_weights
from grpo_ds.algo.importance import truncated_importance_weights
from grpo_ds.algo.policy_loss import LossConfig
from grpo_ds.algo.truncation import Truncation
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed.ranks import Dist
from grpo_ds.rollout.base import Rollouts
from grpo_ds.step.batch import PerSample, StepBatch
from grpo_ds.step.loss import (
    LossSettings,
    LossStats,
    TokenTerms,
    backward,
    discard_gradients,
    micro_batch_loss,
    token_logprobs,
)
from grpo_ds.step.micro_batch import (
    MicroBatch,
    collate,
    gather_per_token,
    per_token,
    shard_sequences,
    split_per_sample,
)
from grpo_ds.step.plan import MiniBatchPlan


@dataclass(frozen=True)
class UpdateSettings:
    """What the update phases need from the recipe."""

    pad_id: int
    loss_agg: str
    loss_agg_norm_tokens: int
    loss: LossSettings
    # completions cut by the length limit get no loss (DAPO's overlong filtering)
    mask_truncated: bool
    # truncated importance weight min(pi_old / pi_sampler, cap); None = off
    rollout_is_cap: float | None
    packed: bool = True  # the micro-batch layout (grpo_ds.step.micro_batch)
    one_row: bool = False  # packed into a single row (flash attention takes the boundaries)
    # > 0: Ulysses shards every micro-batch of this many rows (sequence_parallel)
    sequence_parallel_rows: int = 0

    @staticmethod
    def from_recipe(
        recipe: Recipe,
        pad_id: int,
        backend: str,
        fused_lm_head_allowed: bool = True,
        packing_allowed: bool = True,
        one_row: bool = False,
    ) -> UpdateSettings:
        """``backend``: the resolved kernels backend ("triton" or "torch", see
        grpo_ds.config.software.resolve_backend); ``fused_lm_head_allowed`` / ``packing_allowed`` /
        ``one_row``: what the model can take (grpo_ds.model.policy)."""
        a = recipe.algorithm
        sp = recipe.train.sequence_parallel_size
        config = LossConfig.from_recipe(a)
        k = recipe.kernels
        # the trainer's log-probs replay the sampler's distribution (grpo_ds.algo.truncation)
        r = recipe.rollout
        loss = LossSettings(
            config,
            r.temperature,
            backend,
            k.logprob_chunk_tokens,
            k.fused_lm_head and fused_lm_head_allowed,
            k.logprob_chunk_mib,
            Truncation(r.top_k, r.top_p),
            recipe.model.router_aux_loss_coef,
        )
        return UpdateSettings(
            pad_id,
            a.loss_agg,
            recipe.loss_agg_norm_tokens,
            loss,
            a.mask_truncated,
            a.rollout_is_cap,
            recipe.train.packing and packing_allowed and sp == 1,
            one_row,
            recipe.sequence_parallel_rows if sp > 1 else 0,
        )


def _micro_batch(
    rollouts: Rollouts,
    ids: tuple[int, ...],
    plan: MiniBatchPlan,
    settings: UpdateSettings,
    dist: Dist,
) -> MicroBatch:
    # A padding micro-batch () runs a real sample with weight 0: every rank must run the same
    # forwards and backwards, because ZeRO-3 gathers parameters collectively inside them.
    mb = collate(
        rollouts,
        list(ids) or [plan.sample_ids[0]],
        settings.pad_id,
        dist.device,
        padding=not ids,
        packed=settings.packed,
        one_row=settings.one_row,
    )
    if settings.sequence_parallel_rows:
        mb = shard_sequences(
            mb, settings.sequence_parallel_rows, dist.sp_rank, dist.sp_size, settings.pad_id
        )
    return mb


@torch.no_grad()
def logprob_pass(engine, data: StepBatch, settings: UpdateSettings, dist: Dist) -> PerSample:
    """Per-token log-probs of every sample under `engine`'s current weights: {sample id: (L_i,)} on
    every rank."""
    engine.eval()
    plan = data.plan.logprob_pass
    mine: PerSample = {}
    for ids in plan.micro_batches[dist.dp_rank]:
        mb = _micro_batch(data.rollouts, ids, plan, settings, dist)
        logprobs = token_logprobs(engine, mb, settings.loss)
        if ids:
            mine.update(split_per_sample(logprobs, mb))
    pieces: dict[int, list[torch.Tensor]] = {}
    # tensor-parallel ranks repeat; sequence-parallel ones
    for part in dist.all_gather(mine)[:: dist.tp_size]:
        for sid, values in part.items():  # hold consecutive slices, in rank order
            pieces.setdefault(sid, []).append(values)
    return {sid: torch.cat(values) for sid, values in pieces.items()}


def optimizer_step(
    engine, data: StepBatch, minibatch: MiniBatchPlan, settings: UpdateSettings, dist: Dist
) -> tuple[LossStats, bool]:
    """Backward over this rank's micro-batches of `minibatch`, then one optimizer step.

    ``data.old_logprobs`` None means the policy has not changed since the rollout (one optimizer
    step per rollout), so the old log-probs are the current ones, detached. Returns this rank's
    LossStats and whether the optimizer stepped (False: a non-finite loss on some rank, the update
    was skipped).
    """
    engine.train()
    rollouts = data.rollouts
    lengths = [trained_tokens(rollouts, s, settings) for s in minibatch.sample_ids]
    weights = sequence_weights(lengths, settings.loss_agg, settings.loss_agg_norm_tokens).tolist()
    weight_of = dict(zip(minibatch.sample_ids, weights, strict=True))
    advantage = torch.tensor(data.advantages, dtype=torch.float32, device=dist.device)  # (P*G,)
    stats = LossStats()
    finite = True
    for ids in minibatch.micro_batches[dist.dp_rank]:
        mb = _micro_batch(rollouts, ids, minibatch, settings, dist)
        terms = _token_terms(data, mb, advantage, weight_of, settings)
        loss, mb_stats = micro_batch_loss(engine, mb, terms, settings.loss)
        # ZeRO-3 averages over the sequence-parallel ranks too
        backward(engine, loss, dist.dp_size * dist.sp_size)
        finite = finite and bool(torch.isfinite(loss))
        stats += mb_stats
    # NaN guard: every rank ran every backward (ZeRO-3's collectives need it); if any rank saw a
    # non-finite loss, all of them drop the accumulated gradients instead of stepping.
    nonfinite = torch.tensor([0.0 if finite else 1.0])
    dist.all_reduce_sum(nonfinite)
    if nonfinite.item() > 0:
        discard_gradients(engine)
        return stats, False
    engine.step()
    return stats, True


def _token_terms(
    data: StepBatch,
    mb: MicroBatch,
    advantage: torch.Tensor,
    weight_of: dict[int, float],
    settings: UpdateSettings,
) -> TokenTerms:
    device = mb.target_ids.device
    sequence_weight = torch.tensor(
        [0.0 if mb.padding else weight_of[s] for s in mb.sample_ids],
        dtype=torch.float32,
        device=device,
    )  # (S,) w_i
    old = gather_per_token(data.old_logprobs, mb)
    token_factor = mb.loss_mask  # (N,)
    if settings.rollout_is_cap is not None:
        sampler = per_token([data.rollouts.sampler_logprobs[s] for s in mb.sample_ids], mb)  # (N,)
        token_factor = token_factor * truncated_importance_weights(
            old, sampler, settings.rollout_is_cap
        )
    ref = gather_per_token(data.ref_logprobs, mb) if settings.loss.config.kl_coef > 0 else None
    advantages = advantage[torch.tensor(mb.sample_ids, device=device)]  # (S,)
    return TokenTerms(advantages, sequence_weight[mb.seq_index] * token_factor, old, ref)


def importance_metrics(rollouts: Rollouts, old_logprobs: PerSample, cap: float) -> dict:
    """The truncated importance weights over the trained tokens (mean, min, max), the fraction the
    cap truncated, and the largest gap between the trainer's and the sampler's log-probs of a token
    (0 where the sampler held exactly the trainer's weights and computes the same way: the hf engine
    at float32, colocated or split at staleness 0)."""
    old, sampler = [], []
    for i in range(len(rollouts)):
        keep = torch.tensor(rollouts.token_loss_mask(i), dtype=torch.bool)
        old.append(old_logprobs[i][keep])
        sampler.append(torch.tensor(rollouts.sampler_logprobs[i], dtype=torch.float32)[keep])
    old_t, sampler_t = torch.cat(old), torch.cat(sampler)
    if old_t.numel() == 0:  # no trained token (every response empty or masked)
        return {
            k: math.nan
            for k in (
                "is_weight_mean",
                "is_weight_min",
                "is_weight_max",
                "is_truncated_frac",
                "sampler_logprob_gap_max",
            )
        }
    weights = truncated_importance_weights(old_t, sampler_t, cap)
    return {
        "is_weight_mean": weights.mean().item(),
        "is_weight_min": weights.min().item(),
        "is_weight_max": weights.max().item(),
        "is_truncated_frac": ((old_t - sampler_t).exp() > cap).float().mean().item(),
        "sampler_logprob_gap_max": (old_t - sampler_t).abs().max().item(),
    }


def trained_tokens(rollouts: Rollouts, sample: int, settings: UpdateSettings) -> int:
    """L_i of the loss aggregation: the sample's model tokens, or 0 when it is masked out as
    truncated."""
    if settings.mask_truncated and rollouts.finish_reason[sample] == "length":
        return 0
    return rollouts.trained_tokens(sample)
