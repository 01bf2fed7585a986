"""One micro-batch's loss (grpo_ds/step/loss.py). Each variant (full logits, fused lm_head,
GSPO) gives sum_t token_weight_t l_t, its gradient and its statistics as the reference math
(grpo_ds.algo) gives them for each sequence alone; on-policy that sum is the hand-computed
-sum_i A_i; the MoE routers' term is c x L_aux x sum_t token_weight_t; a padding micro-batch
trains nothing; LossStats add field by field; and a real one-rank DeepSpeed engine receives the
sum of the partials, not their average."""

import dataclasses

import pytest
import torch

from grpo_ds.algo.logprobs import rows_logprobs_and_entropy
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.algo.router import load_balancing_loss
from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.model.engine import create_train_engine
from grpo_ds.model.tiny import build_tiny_model
from grpo_ds.rollout.base import Rollouts
from grpo_ds.step.loss import (
    LossSettings,
    LossStats,
    TokenTerms,
    backward,
    discard_gradients,
    micro_batch_loss,
)
from grpo_ds.step.micro_batch import MicroBatch, collate
from tests.algo.loss_configs import loss_config
from tests.scripts.one_step import VOCAB, fixed_rollouts

CPU = torch.device("cpu")
TEMPERATURE = 0.7  # not 1: the log-probs are those of softmax(logits / T)
# of fixed_rollouts' 9 samples, 17, 12, 4, 5, 15 and 7 tokens long: packed into rows of 17, the
# 12 and the 5 share a row, and the 7 and the 4 (the layout differs from each sequence alone)
IDS = [5, 1, 3, 8, 6, 0]
# (policy loss, fused lm_head): the three code paths of micro_batch_loss, and GSPO's log-probs
# through the fused head
VARIANTS = {
    "full-logits": ("ppo_clip", False),
    "fused-lm-head": ("ppo_clip", True),
    "gspo": ("gspo", False),
    "gspo-fused": ("gspo", True),
}
# float32 throughout: the packed forward and the kernels' chunked sums differ from each sequence's
# own forward by float rounding only (measured worst over the variants: 1.2e-7 in a loss of 0.76,
# 1.8e-7 in a gradient element, the largest 0.80)
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def _model(**moe) -> torch.nn.Module:
    return build_tiny_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=0, **moe)


def _rollouts() -> tuple[Rollouts, torch.Tensor]:
    """fixed_rollouts as multi-turn samples: every third response token is an environment
    observation (loss mask 0), so each sequence keeps its first token to train. Returns them and
    their advantages."""
    rollouts, advantages = fixed_rollouts()
    mask = [[0 if t % 3 == 2 else 1 for t in range(len(r))] for r in rollouts.response_ids]
    return dataclasses.replace(rollouts, loss_mask=mask), torch.tensor(advantages)


def _terms(
    rollouts: Rollouts, advantages: torch.Tensor, mb: MicroBatch, around: torch.Tensor | None = None
) -> TokenTerms:
    """w_i = 1 / L_i on each of sequence i's L_i trained tokens, 0 on its observation tokens.
    Without ``around``: on-policy, no KL term. With ``around`` (N,) log-probs: old and reference
    log-probs drawn within 0.5 of them (ratios up to e^0.5, so some tokens clip)."""
    trained = torch.tensor([float(sum(rollouts.loss_mask[s])) for s in mb.sample_ids])  # (S,) L_i
    weight = mb.loss_mask / trained[mb.seq_index]  # (N,)
    sequences = advantages[mb.sample_ids]  # (S,)
    if around is None:
        return TokenTerms(sequences, weight, None, None)
    g = torch.Generator().manual_seed(1)
    old = around + torch.rand(around.shape, generator=g) - 0.5
    ref = around + torch.rand(around.shape, generator=g) - 0.5
    return TokenTerms(sequences, weight, old, ref)


def _alone(model, rollouts: Rollouts, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) (N,) of the response tokens, each sequence through the model on its
    own and scored by grpo_ds.algo.logprobs: the reference for the micro-batch's layout and
    kernels."""
    logprobs, entropies = [], []
    for sid in ids:
        prompt, response = rollouts.prompt_ids[sid], rollouts.response_ids[sid]
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]  # (P + R, V)
        # (R, V): the positions that predict the response tokens
        rows = logits[len(prompt) - 1 : len(prompt) + len(response) - 1]
        lp, h = rows_logprobs_and_entropy(rows, torch.tensor(response), TEMPERATURE)
        logprobs.append(lp)
        entropies.append(h)
    return torch.cat(logprobs), torch.cat(entropies)


def _reference(
    model, rollouts: Rollouts, mb: MicroBatch, terms: TokenTerms, config: LossConfig
) -> tuple[torch.Tensor, list[float]]:
    """sum_t token_weight_t l_t by grpo_ds.algo.policy_loss, and the KL, entropy and clipped sums
    over the trained tokens (token_weight > 0)."""
    logprobs, entropy = _alone(model, rollouts, mb.sample_ids)
    per_token, kl, clipped = token_losses(
        logprobs,
        terms.old_logprobs,
        terms.advantages[mb.seq_index],
        terms.ref_logprobs,
        entropy,
        config,
        (mb.seq_index, terms.token_weight),
    )
    counted = terms.token_weight > 0
    sums = [t.detach()[counted].sum().item() for t in (kl, entropy, clipped)]
    return (per_token * terms.token_weight).sum(), sums


def _settings(policy_loss: str, fused: bool, **config) -> LossSettings:
    return LossSettings(
        loss_config(policy_loss=policy_loss, **config),
        TEMPERATURE,
        "torch",
        chunk_tokens=16,
        fused_lm_head=fused,
    )


@pytest.mark.parametrize(("policy_loss", "fused"), VARIANTS.values(), ids=VARIANTS.keys())
def test_each_variant_is_the_reference_loss_of_each_sequence_alone(policy_loss, fused):
    """Off-policy, with a KL and an entropy term and some tokens clipped: the packed micro-batch's
    loss, its gradient and its statistics are those of the reference math on each sequence's own
    forward."""
    model = _model()
    rollouts, advantages = _rollouts()
    mb = collate(rollouts, IDS, 0, CPU)
    assert mb.position_ids is not None and mb.input_ids.shape[0] < len(IDS)  # rows shared: packed
    with torch.no_grad():
        around, _ = _alone(model, rollouts, IDS)
    terms = _terms(rollouts, advantages, mb, around)
    settings = _settings(
        policy_loss, fused, clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01
    )
    params = list(model.parameters())

    loss, stats = micro_batch_loss(model, mb, terms, settings)
    got = torch.autograd.grad(loss, params)
    expected, (kl, entropy, clipped) = _reference(model, rollouts, mb, terms, settings.config)
    want = torch.autograd.grad(expected, params)

    counted = int((terms.token_weight > 0).sum())
    assert 0 < clipped < counted  # the terms reach the clip on some trained tokens, not all
    torch.testing.assert_close(loss, expected, **LOSS_TOL)
    for name, g, w in zip([n for n, _ in model.named_parameters()], got, want, strict=True):
        torch.testing.assert_close(g, w, **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert stats.loss == loss.item()
    assert stats.clipped_tokens == clipped
    assert (stats.kl, stats.entropy) == pytest.approx((kl, entropy), rel=1e-5)
    assert stats.response_tokens == sum(sum(rollouts.loss_mask[s]) for s in IDS)  # observations not
    assert stats.sequence_tokens == sum(
        len(rollouts.prompt_ids[s]) + len(rollouts.response_ids[s]) for s in IDS
    )
    assert (stats.router_aux, stats.router_aux_tokens) == (0.0, 0.0)


@pytest.mark.parametrize(("policy_loss", "fused"), VARIANTS.values(), ids=VARIANTS.keys())
def test_on_policy_each_sequence_adds_minus_its_advantage(policy_loss, fused):
    """By hand: on-policy every ratio is exactly 1 and nothing clips, so without KL and entropy
    terms l_t = -A_i. With w_i = 1 / L_i on sequence i's L_i trained tokens the micro-batch's loss
    is -sum_i A_i: a sum over the micro-batch (not a mean), each sequence once whatever its
    length."""
    rollouts, advantages = _rollouts()
    mb = collate(rollouts, IDS, 0, CPU)
    terms = _terms(rollouts, advantages, mb)
    loss, stats = micro_batch_loss(_model(), mb, terms, _settings(policy_loss, fused))
    assert loss.item() == pytest.approx(-advantages[IDS].sum().item(), abs=1e-6)
    assert (stats.kl, stats.clipped_tokens) == (0.0, 0.0)


def test_a_padding_micro_batch_trains_nothing_and_counts_nothing():
    """A padding micro-batch (a rank with no samples left runs one, for ZeRO-3's collectives) has
    token weights 0: its loss is 0 with a zero gradient, yet differentiable (its backward runs),
    and it adds nothing to the step's statistics."""
    model = _model()
    rollouts, advantages = _rollouts()
    mb = collate(rollouts, IDS[:2], 0, CPU, padding=True)
    terms = dataclasses.replace(
        _terms(rollouts, advantages, mb), token_weight=torch.zeros(mb.num_tokens)
    )
    loss, stats = micro_batch_loss(model, mb, terms, _settings("ppo_clip", True))
    assert loss.item() == 0.0 and loss.requires_grad
    assert all(not g.any() for g in torch.autograd.grad(loss, list(model.parameters())))
    assert stats == LossStats()


def test_the_routers_term_is_c_times_l_aux_times_the_micro_batchs_token_weight():
    """model.router_aux_loss_coef c: the loss adds c x L_aux(mb) x sum_t token_weight_t, L_aux by
    grpo_ds.algo.router over the forward's real tokens; the statistics carry L_aux weighted by the
    micro-batch's response tokens, which router_metrics divides back out."""
    model = _model(num_experts=4, experts_per_token=2)
    rollouts, advantages = _rollouts()
    mb = collate(rollouts, IDS, 0, CPU)
    terms = _terms(rollouts, advantages, mb)
    off = _settings("ppo_clip", False)
    loss_off, stats_off = micro_batch_loss(model, mb, terms, off)
    on = dataclasses.replace(off, router_aux_coef=0.01)
    loss_on, stats_on = micro_batch_loss(model, mb, terms, on)
    with torch.no_grad():
        routed = model(**mb.model_inputs(), output_router_logits=True).router_logits
        aux = load_balancing_loss(routed, 2, mb.token_mask).item()
    added = 0.01 * aux * terms.token_weight.sum().item()
    assert added > 1e-4  # well above the float32 rounding of the loss
    assert loss_on.item() == pytest.approx(loss_off.item() + added, rel=1e-6)
    response = sum(sum(rollouts.loss_mask[s]) for s in IDS)
    assert stats_on.router_aux == pytest.approx(aux * response, rel=1e-6)
    assert stats_on.router_aux_tokens == response
    assert stats_on.router_metrics() == {"router_aux_loss": pytest.approx(aux, rel=1e-6)}
    assert stats_off.router_metrics() == {}


def test_loss_stats_add_field_by_field():
    a = LossStats(
        loss=1.5,
        kl=0.25,
        entropy=3.0,
        clipped_tokens=2.0,
        response_tokens=10.0,
        sequence_tokens=16.0,
        router_aux=0.5,
        router_aux_tokens=10.0,
    )
    b = LossStats(
        loss=-0.5,
        kl=0.5,
        entropy=1.0,
        clipped_tokens=1.0,
        response_tokens=6.0,
        sequence_tokens=9.0,
        router_aux=1.5,
        router_aux_tokens=6.0,
    )
    total = LossStats()
    for stats in (a, b):  # as the update sums its micro-batches
        total += stats
    assert (
        total
        == a + b
        == LossStats(
            loss=1.0,
            kl=0.75,
            entropy=4.0,
            clipped_tokens=3.0,
            response_tokens=16.0,
            sequence_tokens=25.0,
            router_aux=2.0,
            router_aux_tokens=16.0,
        )
    )
    assert total.router_metrics() == {"router_aux_loss": 2.0 / 16.0}
    assert LossStats().router_metrics() == {}  # no router term: no metric, not a division by 0


class _OtherRanks:
    """A stand-in for grpo_ds.distributed.ranks.Dist's sum over ranks: several ranks need a
    launched process group, which this test process has not. all_reduce_sum adds the other ranks'
    LossStats in place, in the dataclass's field order, as the real one adds theirs."""

    def __init__(self, others: list[LossStats], tp_size: int):
        self.others, self.tp_size = others, tp_size

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        for other in self.others:
            tensor += torch.tensor(dataclasses.astuple(other), dtype=torch.float64)


def test_summed_over_ranks_counts_each_tensor_parallel_group_once():
    """Four ranks in two tensor-parallel groups of 2: a group's ranks compute the same
    micro-batches, so the step's sums are one rank's of each group."""
    first = LossStats(1.5, 0.25, 3.0, 2.0, 10.0, 16.0, 0.5, 10.0)
    second = LossStats(-0.5, 0.5, 1.0, 1.0, 6.0, 9.0, 1.5, 6.0)
    summed = first.summed_over_ranks(_OtherRanks([first, second, second], tp_size=2))
    assert summed == first + second


def _one_rank_engine():
    """A real DeepSpeed engine over the tiny model on this process's one rank, from the config
    grpo_ds resolves (ZeRO stage 1, managed_gradient_accumulation false), with 2 micro-batches per
    step."""
    init_distributed()
    recipe = load_recipe(
        {"train": {"micro_batch_samples_per_gpu": 2, "samples_per_optimizer_step": 4}}
    )
    config = resolve_deepspeed_config(recipe, 1, "cpu")
    assert config["gradient_accumulation_steps"] == 2
    return create_train_engine(_model(), config)


def _engine_gradients(engine) -> list[torch.Tensor]:
    """The gradient accumulated since the last step, per parameter (zeros where ZeRO dropped it)."""
    from deepspeed.utils import safe_get_full_grad

    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
    return [
        torch.zeros_like(p) if g is None else g
        for g, p in zip(grads, engine.module.parameters(), strict=True)
    ]


def _halves(rollouts: Rollouts, advantages: torch.Tensor) -> list[tuple[MicroBatch, TokenTerms]]:
    """Two micro-batches of IDS, on-policy."""
    mbs = [collate(rollouts, ids, 0, CPU) for ids in (IDS[:2], IDS[2:])]
    return [(mb, _terms(rollouts, advantages, mb)) for mb in mbs]


def test_backward_hands_deepspeed_the_sum_of_the_partials_times_the_ranks_it_averages_over():
    """Two micro-batches through backward on an engine that accumulates 2 per step: the gradient is
    that of the partial losses' sum (scale_wrt_gas=False: DeepSpeed does not divide by its 2
    micro-batches), times averaged_over (here 2, as on one of 2 data-parallel ranks; DeepSpeed
    divides by the ranks at the step, which one rank shows by not dividing)."""
    engine, reference = _one_rank_engine(), _model()
    rollouts, advantages = _rollouts()
    settings = _settings("ppo_clip", True)
    total = 0.0
    for mb, terms in _halves(rollouts, advantages):
        loss, _ = micro_batch_loss(engine, mb, terms, settings)
        backward(engine, loss, averaged_over=2)
        total = total + micro_batch_loss(reference, mb, terms, settings)[0]
    want = torch.autograd.grad(total, list(reference.parameters()))
    for got, w in zip(_engine_gradients(engine), want, strict=True):
        torch.testing.assert_close(got, 2 * w, **GRAD_TOL)


def test_discard_gradients_forgets_the_micro_batches_since_the_last_step():
    """The NaN guard's path on a real engine: after a discard the next backward holds the second
    micro-batch's gradient alone (nothing is left of the first's), and the step counts that one
    micro-batch's samples (DeepSpeed's count of backwards since the last step restarts too)."""
    engine, reference = _one_rank_engine(), _model()
    rollouts, advantages = _rollouts()
    settings = _settings("ppo_clip", True)
    (first, first_terms), (second, second_terms) = _halves(rollouts, advantages)
    backward(engine, micro_batch_loss(engine, first, first_terms, settings)[0], 1)
    assert any(g.any() for g in _engine_gradients(engine))
    discard_gradients(engine)
    backward(engine, micro_batch_loss(engine, second, second_terms, settings)[0], 1)
    want = torch.autograd.grad(
        micro_batch_loss(reference, second, second_terms, settings)[0], list(reference.parameters())
    )
    for got, w in zip(_engine_gradients(engine), want, strict=True):
        torch.testing.assert_close(got, w, **GRAD_TOL)
    engine.step()
    assert engine.global_samples == 2  # one micro-batch of 2 samples, not the discarded one's too
