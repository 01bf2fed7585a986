"""Train through the real driver, record every optimizer step, and recompute each one with
grpo_ds/algo.

``record_run`` runs ``grpo_ds.train.run`` with two functions wrapped:
``grpo_ds.train.optimizer_step`` (the full weights before and after each optimizer step, the step's
data, its mini-batch, settings and returned LossStats) and ``grpo_ds.step.update.micro_batch_loss``
(the TokenTerms each micro-batch was given). ``Run.reference`` recomputes one recorded optimizer
step from the rollouts, the rewards and the weights alone, with the reference math of grpo_ds/algo
(reward shaping, advantages, sequence weights, importance weights, per-token losses) and autograd on
a plain, unsharded copy of the model (full logits of right-padded rows): the driver's kernels,
micro-batches, flat token layout and ZeRO-3 take no part in it.

The optimizer is AdamW with betas (0, 0) and eps = 1e4: each step is exactly -lr * g / (|g| + eps),
with no memory of earlier steps. eps is far above any |g| here, so it is a plain gradient step of
size STEP_SIZE = lr / eps (linear in g to 1e-4): the weight change of any optimizer step, not only
the first, shows that step's gradient, and the difference between two runs' weight changes shows the
difference of their gradients.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

import grpo_ds.step.update
import grpo_ds.train
from grpo_ds.algo.advantages import group_advantages
from grpo_ds.algo.aggregation import sequence_weights
from grpo_ds.algo.importance import truncated_importance_weights
from grpo_ds.algo.logprobs import token_logprobs_and_entropy
from grpo_ds.algo.names import ESTIMATORS
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.algo.shaping import kl_reward_penalty, overlong_penalty
from grpo_ds.algo.truncation import Truncation
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.recipe import Recipe
from grpo_ds.model.tiny import EOS, build_tiny_model, build_tiny_tokenizer
from grpo_ds.model.weight_gather import gathered_named_parameters
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.loss import LossStats, TokenTerms
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")
EPS = 1e4
STEP_SIZE = 1.0  # lr / eps: every optimizer step moves the weights by -STEP_SIZE x the gradient

# 4 prompts x 4 samples of at most 3 tokens. Two optimizer steps of 8 samples (one micro-batch each)
# per rollout: the second one trains a policy that has moved since sampling (PPO ratios != 1) and
# away from the reference (KL != 0). Sampling keeps the 50 most likely tokens, and every log-prob
# (the policy's, the old policy's, the reference's) is taken over that set, the reference math's as
# the driver's (grpo_ds.algo.truncation). No gradient clipping, no checkpoints.
# run.seed 2: a seed whose samples give every test here what it needs (groups with equal and unequal
# rewards, clipped tokens at the second step, ...); seed 0 stopped doing so when each sample got its
# own random stream (grpo_ds.rollout.streams), and seeds 1 and 4 leave one test without its case.
BASE = {
    "run.seed": 2,
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 3,
    "rollout.top_k": 50,
    "train.micro_batch_samples_per_gpu": 8,
    "train.samples_per_optimizer_step": 8,
    "train.steps": 1,
    "train.lr": STEP_SIZE * EPS,
    "train.adam_betas": [0.0, 0.0],
    "train.max_grad_norm": 0.0,
    "deepspeed": {
        **json.loads((REPO / "ds_configs" / "zero3.json").read_text()),
        "optimizer": {"type": "AdamW", "params": {"eps": EPS}},
    },
    "reward.functions": [{"name": "tests.option_runs:even_first_token"}],
    "checkpoint.every_steps": None,
    "run.save_final_model": False,
    "logging.progress_bar": False,
    "logging.samples_every_steps": None,
}


def even_first_token(*, completion_ids: list[list[int]], **_) -> list[float]:
    """1.0 when the completion's first token id is even (not EOS, which is 1): about 4 samples in
    10, so most groups of 4 have unequal rewards and some do not (what dynamic sampling drops).
    exact_match would give a random model nothing but zeros."""
    return [float(ids[0] % 2 == 0) for ids in completion_ids]


def save_test_model(folder) -> str:
    """builtin:tiny's model and tokenizer as a model folder, changed so that EOS is likely (about a
    third of the sampled tokens instead of 1 in 100): completions of 1 to 3 tokens, some stopped by
    EOS and some cut by the length limit, which the length options (mask_truncated, the overlong
    penalty, loss aggregation) need.

    Dimension 0 of every token embedding is 2 and the EOS row of the lm_head reads it. The
    embeddings are first scaled from std 0.02 to 1: the RMS normalisations after them would
    otherwise turn a small step of those tiny weights into a large change of the logits (a shared
    dimension 0 of 0.02 makes EOS's probability swing by orders of magnitude in one step)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)
        model.model.embed_tokens.weight[:, 0] = 2.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids(EOS), 0] = 2.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# ---------------------------------------------------------------------------------------- recording


@dataclass
class OptimizerStep:
    """One optimizer step as the driver ran it."""

    step: int  # the rollout step (1-based)
    index: int  # which optimizer step of that rollout (0-based)
    data: StepBatch
    sample_ids: tuple[int, ...]  # its mini-batch
    settings: grpo_ds.step.update.UpdateSettings
    before: dict[str, torch.Tensor]  # full weights before the step
    after: dict[str, torch.Tensor] = field(default_factory=dict)  # and after it
    stats: LossStats | None = None  # what optimizer_step returned
    # per micro-batch: sample ids, terms
    terms: list[tuple[list[int], TokenTerms]] = field(default_factory=list)

    def delta(self) -> torch.Tensor:
        """The weight change, flat (float64)."""
        return flat(self.after) - flat(self.before)

    def resolution(self) -> float:
        """The norm of the float32 spacing of the weights after the step: how exactly a weight
        change is stored."""
        inf = torch.tensor(float("inf"))
        return flat({n: torch.nextafter(w, inf) - w for n, w in self.after.items()}).norm().item()

    def token_weights(self) -> dict[int, torch.Tensor]:
        """{sample id: (L_i,) the token weights its micro-batch's loss was given}."""
        out = {}
        for ids, terms in self.terms:
            sizes = [len(self.data.rollouts.response_ids[s]) for s in ids]
            out.update(zip(ids, terms.token_weight.detach().cpu().split(sizes), strict=True))
        return out


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[name].reshape(-1).double() for name in sorted(weights)])


def _full_weights(engine) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().to("cpu", copy=True)
        for name, t in gathered_named_parameters(engine.module, 2**26)
    }


@dataclass
class Run:
    recipe: Recipe
    metrics: list[dict]
    steps: list[OptimizerStep]
    _references: dict = field(default_factory=dict)  # (step, index) -> Reference
    _scores: dict = field(default_factory=dict)  # ("old" | "ref", step) -> {sample id: log-probs}

    def at(self, step: int, index: int = 0) -> OptimizerStep:
        return next(o for o in self.steps if (o.step, o.index) == (step, index))

    def reference(self, step: int, index: int = 0) -> Reference:
        """The optimizer step recomputed with grpo_ds/algo (``reference_step``), once."""
        if (step, index) not in self._references:
            self._references[step, index] = reference_step(self, self.at(step, index))
        return self._references[step, index]


def record_run(output_dir, name: str, overrides: dict, sampler_shift: float = 0.0) -> Run:
    """Train tiny_cpu.json with BASE and ``overrides`` through the driver; record every optimizer
    step.

    ``sampler_shift``: the hf engine's recorded log-probs are moved by +-shift, alternating token by
    token, as if the sampler computed another distribution than the trainer's (what staleness, vLLM
    or another precision do, and what a colocated float32 hf run at staleness 0 never does: there
    the importance weights are exactly 1)."""
    overrides = {**BASE, "run.output_dir": str(output_dir), "run.name": name, **overrides}
    steps: list[OptimizerStep] = []
    real_step, real_loss = grpo_ds.train.optimizer_step, grpo_ds.step.update.micro_batch_loss
    real_generate = HFRolloutEngine.generate

    def generate(self, *args, **kwargs):
        rollouts = real_generate(self, *args, **kwargs)
        rollouts.sampler_logprobs = [
            [lp + sampler_shift * (-1) ** t for t, lp in enumerate(sample)]
            for sample in rollouts.sampler_logprobs
        ]
        return rollouts

    def optimizer_step(engine, data, minibatch, settings, dist):
        step = 1 if not steps else steps[-1].step + (steps[-1].data is not data)
        index = sum(1 for o in steps if o.step == step)
        steps.append(
            OptimizerStep(step, index, data, minibatch.sample_ids, settings, _full_weights(engine))
        )
        steps[-1].stats, stepped = real_step(engine, data, minibatch, settings, dist)
        steps[-1].after = _full_weights(engine)
        return steps[-1].stats, stepped

    def micro_batch_loss(model, mb, terms, s):
        if not mb.padding:
            steps[-1].terms.append((list(mb.sample_ids), terms))
        return real_loss(model, mb, terms, s)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_ds.train, "optimizer_step", optimizer_step)
        patch.setattr(grpo_ds.step.update, "micro_batch_loss", micro_batch_loss)
        if sampler_shift:
            patch.setattr(HFRolloutEngine, "generate", generate)
        metrics = grpo_ds.train.run(TINY, overrides)
    return Run(load_recipe(TINY, overrides), metrics, steps)


# ------------------------------------------------------------------------------- the reference math


@dataclass
class Reference:
    """One optimizer step recomputed with grpo_ds/algo."""

    advantages: torch.Tensor  # (P*G,) of the whole rollout, after reward shaping
    # (P*G,) the reward shaping terms that were on ("overlong", "kl")
    penalties: dict[str, torch.Tensor]
    # {sample id: (L_i,)} w_i x loss mask x importance weight
    token_weights: dict[int, torch.Tensor]
    # {sample id: (L_i,)} min(pi_old / pi_sampler, cap) (ones when off)
    importance: dict[int, torch.Tensor]
    # loss, KL, entropy and clipped sums over the trained tokens, as the driver's LossStats
    stats: LossStats
    # per token of the mini-batch, flat (N,) in sample_ids order:
    token_advantage: torch.Tensor
    ratio: torch.Tensor  # pi / pi_old
    clipped: torch.Tensor  # 1.0 where a clip changed the token's loss
    seq_index: torch.Tensor  # which sample of sample_ids the token is in
    # the predicted weight change: Adam's step on the reference gradient (flat)
    update: torch.Tensor


_SKELETON: list[torch.nn.Module] = []


def policy_model(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain copy of the policy holding ``weights`` (one skeleton, reloaded: building a model is
    slow)."""
    if not _SKELETON:
        _SKELETON.append(build_tiny_model(weights["model.embed_tokens.weight"].shape[0]))
    model = _SKELETON[0]
    model.load_state_dict(weights, strict=True)
    model.zero_grad(set_to_none=True)
    return model


def _logprobs(
    model, recipe: Recipe, data: StepBatch, samples: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log-probs, entropies) (L_i,) of each sample's response tokens, from full logits of one
    forward over the samples as right-padded rows (the causal mask keeps padding out of every real
    position)."""
    rollouts = data.rollouts
    sequences = [rollouts.prompt_ids[i] + rollouts.response_ids[i] for i in samples]
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    logits = model(input_ids=input_ids, attention_mask=mask).logits  # (B, T, V)
    out = []
    for row, i in enumerate(samples):
        start = len(rollouts.prompt_ids[i]) - 1  # position t predicts token t + 1
        response = rollouts.response_ids[i]
        out.append(
            token_logprobs_and_entropy(
                logits[row, start : start + len(response)],
                torch.tensor(response),
                temperature=recipe.rollout.temperature,
                truncation=Truncation(recipe.rollout.top_k, recipe.rollout.top_p),
            )
        )
    return out


def _scored(
    run: Run, key: tuple, weights: dict[str, torch.Tensor], data: StepBatch
) -> dict[int, torch.Tensor]:
    """{sample id: (L_i,) log-probs} of every sample of ``data`` under ``weights``, once per run and
    ``key``."""
    if key not in run._scores:
        with torch.no_grad():
            everyone = list(range(len(data.rollouts)))
            scored = _logprobs(policy_model(weights), run.recipe, data, everyone)
        run._scores[key] = {i: lp for i, (lp, _) in zip(everyone, scored, strict=True)}
    return run._scores[key]


def reference_step(run: Run, opt: OptimizerStep) -> Reference:
    """Recompute ``opt`` from its rollouts and rewards: the policy holds the weights before it,
    pi_old the weights that sampled the rollout (before its first optimizer step), pi_ref the
    initial weights."""
    recipe, data, a = run.recipe, opt.data, run.recipe.algorithm
    rollouts = data.rollouts
    old = _scored(run, ("old", opt.step), run.at(opt.step).before, data)
    ref = _scored(run, ("ref", opt.step), run.steps[0].before, data)

    # reward shaping, then the estimator's advantages (grpo_ds.algo.shaping,
    # grpo_ds.algo.advantages)
    penalties = {}
    if a.overlong_buffer_tokens is not None:
        penalties["overlong"] = overlong_penalty(
            [len(r) for r in rollouts.response_ids],
            recipe.rollout.max_new_tokens,
            a.overlong_buffer_tokens,
            a.overlong_penalty,
        )
    if a.kl_in_reward:
        everyone = range(len(rollouts))
        penalties["kl"] = kl_reward_penalty(
            [old[i] for i in everyone],
            [ref[i] for i in everyone],
            [rollouts.token_loss_mask(i) for i in everyone],
            a.kl_estimator,
            a.kl_coef,
        )
    shaped = torch.tensor(data.rewards, dtype=torch.float32) + sum(
        penalties.values(), torch.zeros(len(rollouts))
    )
    baseline, scale = ESTIMATORS[a.advantage]
    advantages = group_advantages(
        shaped, recipe.rollout.group_size, baseline, a.scale_rewards or scale
    )

    # token weights: the aggregation's w_i over the whole mini-batch (grpo_ds.algo.aggregation; a
    # truncated sample counts 0 tokens under mask_truncated) x loss mask x importance weight
    # (grpo_ds.algo.importance)
    ids = list(opt.sample_ids)
    lengths = [
        0
        if a.mask_truncated and rollouts.finish_reason[i] == "length"
        else rollouts.trained_tokens(i)
        for i in ids
    ]
    w = sequence_weights(
        lengths, a.loss_agg, a.loss_agg_norm_tokens or recipe.rollout.max_new_tokens
    ).float()
    importance, token_weights = {}, {}
    for i, w_i in zip(ids, w, strict=True):
        importance[i] = torch.ones(len(rollouts.response_ids[i]))
        if a.rollout_is_cap is not None:
            sampler = torch.tensor(rollouts.sampler_logprobs[i], dtype=torch.float32)
            importance[i] = truncated_importance_weights(old[i], sampler, a.rollout_is_cap)
        token_weights[i] = (
            w_i * torch.tensor(rollouts.token_loss_mask(i), dtype=torch.float32) * importance[i]
        )

    # the loss sum_i w_i sum_t l_it (grpo_ds.algo.policy_loss) and its gradient
    model = policy_model(opt.before)
    per_sample = _logprobs(model, recipe, data, ids)
    logprobs = torch.cat([lp for lp, _ in per_sample])  # (N,)
    entropy = torch.cat([h for _, h in per_sample])  # (N,)
    # (N,)
    seq_index = torch.cat([torch.full((len(lp),), b) for b, (lp, _) in enumerate(per_sample)])
    weight = torch.cat([token_weights[i] for i in ids])  # (N,)
    old_flat = torch.cat([old[i] for i in ids])
    token_advantage = advantages[torch.tensor(ids)[seq_index]]
    cfg = LossConfig(
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        kl_coef=0.0 if a.kl_in_reward else a.kl_coef,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        policy_loss=a.policy_loss,
    )
    per_token, kl, clipped = token_losses(
        logprobs,
        old_flat,
        token_advantage,
        torch.cat([ref[i] for i in ids]) if cfg.kl_coef > 0 else None,
        entropy,
        cfg,
        (seq_index, weight),
    )
    loss = (per_token * weight).sum()
    loss.backward()
    counted = weight > 0
    stats = LossStats(
        loss.item(),
        *(t.detach()[counted].sum().item() for t in (kl, entropy, clipped)),
        float(sum(rollouts.trained_tokens(i) for i in ids)),
    )
    params = dict(model.named_parameters())
    gradient = torch.cat([params[name].grad.reshape(-1).double() for name in sorted(opt.before)])
    # AdamW's first step with betas (0, 0)
    update = -recipe.train.lr * gradient / (gradient.abs() + EPS)
    return Reference(
        advantages,
        penalties,
        token_weights,
        importance,
        stats,
        token_advantage,
        (logprobs - old_flat).detach().exp(),
        clipped.detach(),
        seq_index,
        update,
    )
