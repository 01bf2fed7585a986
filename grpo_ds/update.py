"""The two training-side phases of a step: log-prob passes and the policy update.

``logprob_pass`` scores every sample under an engine's current weights (old policy, or the frozen
reference) with the log-prob phase's own micro-batches. ``optimizer_step`` runs one rank's
micro-batches of one mini-batch through the loss, backward, and one optimizer step.

Loss contract (DESIGN.md): the loss of an optimizer step is sum_i w_i sum_t loss_it over the whole
global mini-batch, with w_i from grpo_ds.algo.aggregation computed on all of its sequences' lengths.
Each micro-batch contributes its partial sum; DeepSpeed averages gradients over ranks, so each
rank's partial loss is multiplied by the world size; ``backward(scale_wrt_gas=False)`` stops
DeepSpeed from dividing by accumulation steps. The result does not depend on world size,
micro-batch size, dynamic batching or padding micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_ds.algo.aggregation import sequence_token_weights
from grpo_ds.algo.importance import truncated_importance_weights
from grpo_ds.algo.policy_loss import LossConfig
from grpo_ds.batching import (
    KernelSettings,
    LossTerms,
    MicroBatchTensors,
    collate,
    response_logprobs,
    response_policy_loss,
    split_per_sample,
)
from grpo_ds.engine import Dist
from grpo_ds.planner import MiniBatchPlan
from grpo_ds.recipe import Recipe
from grpo_ds.rollout.base import Rollouts

# Partial sums an optimizer step returns, in this order (summed over ranks by the driver).
TOTALS = ("loss", "kl", "entropy", "clipped_tokens", "response_tokens", "sequence_tokens")


@dataclass(frozen=True)
class UpdateSettings:
    """What the update phases need from the recipe."""

    temperature: float
    pad_id: int
    loss_agg: str
    loss_agg_norm_tokens: int
    loss: LossConfig
    kernels: KernelSettings
    mask_truncated: bool  # completions cut by the length limit get no loss (DAPO's overlong filtering)
    rollout_is_cap: float | None  # truncated importance weight min(pi_old / pi_sampler, cap); None = off

    @staticmethod
    def from_recipe(recipe: Recipe, pad_id: int, backend: str) -> UpdateSettings:
        """``backend``: the resolved kernels backend ("triton" or "torch", see grpo_ds.kernels.resolve_backend)."""
        a = recipe.algorithm
        kl_in_loss = 0.0 if a.kl_in_reward else a.kl_coef
        loss = LossConfig(a.clip_low, a.clip_high, a.dual_clip, kl_in_loss, a.kl_estimator, a.entropy_coef,
                          a.policy_loss)
        ks = KernelSettings(backend, recipe.kernels.logprob_chunk_tokens, recipe.kernels.fused_lm_head)
        return UpdateSettings(recipe.rollout.temperature, pad_id, a.loss_agg, recipe.loss_agg_norm_tokens, loss, ks,
                              a.mask_truncated, a.rollout_is_cap)


def _micro_batch(rollouts: Rollouts, ids: tuple[int, ...], plan: MiniBatchPlan, settings: UpdateSettings,
                 dist: Dist) -> MicroBatchTensors:
    # A padding micro-batch () runs a real sample with weight 0: every rank must run the same
    # forwards and backwards, because ZeRO-3 gathers parameters collectively inside them.
    return collate(rollouts, list(ids) or [plan.sample_ids[0]], settings.pad_id, dist.device)


@torch.no_grad()
def logprob_pass(engine, rollouts: Rollouts, plan: MiniBatchPlan, settings: UpdateSettings, dist: Dist
                 ) -> dict[int, torch.Tensor]:
    """Per-token log-probs of every sample under `engine`'s current weights: {sample id: (L_i,)} on every rank."""
    engine.eval()
    mine: dict[int, torch.Tensor] = {}
    for ids in plan.micro_batches[dist.rank]:
        mb = _micro_batch(rollouts, ids, plan, settings, dist)
        logprobs = response_logprobs(engine, mb, settings.temperature, settings.kernels)
        if ids:
            mine.update(split_per_sample(logprobs, mb))
    merged: dict[int, torch.Tensor] = {}
    for part in dist.all_gather(mine):
        merged.update(part)
    return merged


def optimizer_step(engine, rollouts: Rollouts, minibatch: MiniBatchPlan, advantages: list[float],
                   old_logprobs: dict | None, ref_logprobs: dict | None, settings: UpdateSettings,
                   dist: Dist) -> tuple[torch.Tensor, bool]:
    """Backward over this rank's micro-batches of `minibatch`, then one optimizer step.

    old_logprobs None means the policy has not changed since the rollout (one optimizer step per
    rollout), so the old log-probs are the current ones, detached. Returns this rank's TOTALS and whether
    the optimizer stepped (False: a non-finite loss on some rank, the update was skipped).
    """
    engine.train()
    lengths = [trained_tokens(rollouts, s, settings) for s in minibatch.sample_ids]
    weights = sequence_token_weights(lengths, settings.loss_agg, settings.loss_agg_norm_tokens).tolist()
    weight_of = dict(zip(minibatch.sample_ids, weights, strict=True))
    advantage = torch.tensor(advantages, dtype=torch.float32, device=dist.device)  # (P*G,)
    totals = torch.zeros(len(TOTALS), dtype=torch.float64)
    finite = True
    for ids in minibatch.micro_batches[dist.rank]:
        mb = _micro_batch(rollouts, ids, minibatch, settings, dist)
        sample_ids = torch.tensor(mb.sample_ids, device=dist.device)
        sequence_weight = torch.tensor([weight_of[s] if ids else 0.0 for s in mb.sample_ids], dtype=torch.float32,
                                       device=dist.device)  # (B,)
        old = _per_token(old_logprobs, mb)
        token_factor = mb.loss_mask  # (N_tok,)
        if settings.rollout_is_cap is not None:
            sampler = torch.tensor(sum((rollouts.sampler_logprobs[s] for s in mb.sample_ids), []),
                                   dtype=torch.float32, device=dist.device)  # (N_tok,)
            token_factor = token_factor * truncated_importance_weights(old, sampler, settings.rollout_is_cap)
        terms = LossTerms(advantage[sample_ids], sequence_weight, token_factor, old,
                          _per_token(ref_logprobs, mb) if settings.loss.kl_coef > 0 else None)
        loss, sums = response_policy_loss(engine, mb, terms, settings.loss, settings.temperature, settings.kernels)
        engine.backward(loss * dist.world_size, scale_wrt_gas=False)
        finite = finite and bool(torch.isfinite(loss))
        if ids:
            totals += torch.tensor([loss.item(), *sums.tolist(), float(mb.loss_mask.sum()),
                                    int(mb.attention_mask.sum())], dtype=torch.float64)
    # NaN guard: every rank ran every backward (ZeRO-3's collectives need it); if any rank saw a non-finite loss,
    # all of them drop the accumulated gradients instead of stepping.
    nonfinite = torch.tensor([0.0 if finite else 1.0])
    dist.all_reduce_sum(nonfinite)
    if nonfinite.item() > 0:
        _discard_gradients(engine)
        return totals, False
    engine.step()
    return totals, True


def _discard_gradients(engine) -> None:
    """Forget the gradients accumulated since the last step without stepping: ZeRO's next backward then
    overwrites its gradient partitions (as after a step), and the engine's micro-batch count restarts."""
    engine.optimizer.zero_grad()
    if hasattr(engine, "_unmanaged_backward_count"):  # DeepSpeed's count of backwards since the last step
        engine._unmanaged_backward_count = 0


def needs_sampling_logprobs(recipe: Recipe) -> bool:
    """Whether the step needs the policy's log-probs at sampling time even with one optimizer step per rollout
    (the old-log-prob pass): for the importance weights, or for the KL subtracted from the reward."""
    return recipe.algorithm.rollout_is_cap is not None or recipe.algorithm.kl_in_reward


def importance_metrics(rollouts: Rollouts, old_logprobs: dict[int, torch.Tensor], cap: float) -> dict:
    """Mean truncated importance weight over the trained tokens, and the fraction the cap truncated."""
    old, sampler = [], []
    for i in range(len(rollouts)):
        keep = torch.tensor(rollouts.token_loss_mask(i), dtype=torch.bool)
        old.append(old_logprobs[i][keep])
        sampler.append(torch.tensor(rollouts.sampler_logprobs[i], dtype=torch.float32)[keep])
    old_t, sampler_t = torch.cat(old), torch.cat(sampler)
    weights = truncated_importance_weights(old_t, sampler_t, cap)
    return {"is_weight_mean": weights.mean().item(),
            "is_truncated_frac": ((old_t - sampler_t).exp() > cap).float().mean().item()}


def trained_tokens(rollouts: Rollouts, sample: int, settings: UpdateSettings) -> int:
    """L_i of the loss aggregation: the sample's model tokens, or 0 when it is masked out as truncated."""
    if settings.mask_truncated and rollouts.finish_reason[sample] == "length":
        return 0
    return rollouts.trained_tokens(sample)


def _per_token(per_sample: dict[int, torch.Tensor] | None, mb: MicroBatchTensors) -> torch.Tensor | None:
    if per_sample is None:
        return None
    return torch.cat([per_sample[s] for s in mb.sample_ids]).to(mb.target_ids.device)
