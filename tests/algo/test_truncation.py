"""grpo_ds.algo.truncation: the sampler's set of a position is the one transformers' warpers keep,
the sampled token is always in it, and a trainer that scores over the whole vocabulary instead gets
importance ratios equal to the kept mass (trl#6789's closed form)."""

import pytest
import torch
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo_ds.algo.logprobs import token_logprobs_and_entropy
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation, support_mask, support_threshold

SETTINGS = [
    (1.0, Truncation(top_k=3)),
    (1.0, Truncation(top_p=0.5)),
    (0.7, Truncation(top_k=5, top_p=0.7)),
    (1.3, Truncation(top_k=40, top_p=0.95)),
    (1.5, Truncation(top_p=0.9)),
]


def _rows(n: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    return scale * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


def _warped(logits: torch.Tensor, temperature: float, truncation: Truncation) -> torch.Tensor:
    """The scores transformers' sampler draws from: its warpers in generate's order
    (grpo_ds.rollout.hf uses them)."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if truncation.top_k:
        scores = TopKLogitsWarper(truncation.top_k)(None, scores)
    if truncation.top_p < 1.0:
        scores = TopPLogitsWarper(truncation.top_p)(None, scores)
    return scores


@pytest.mark.parametrize(("temperature", "truncation"), SETTINGS, ids=str)
@pytest.mark.parametrize(("vocab", "scale"), [(105, 1.0), (4000, 3.0)])
def test_the_set_is_the_one_transformers_samples_from(temperature, truncation, vocab, scale):
    logits = _rows(64, vocab, scale, seed=vocab)
    warped = _warped(logits, temperature, truncation)
    kept = torch.isfinite(warped)  # (n, V)
    drawn = torch.multinomial(
        torch.softmax(warped, dim=-1), 1, generator=torch.Generator().manual_seed(1)
    ).squeeze(1)
    differ = support_mask(logits, drawn, temperature, truncation) != kept  # (n, V)
    # only where float32 rounding decides: a token whose mass above it is p to within the sums'
    # rounding (transformers sums the mass below each token in ascending order, grpo_ds the mass
    # above in descending order), rarely
    above = [
        _mass_above(logits[row], temperature, truncation, token)
        for row, token in differ.nonzero().tolist()
    ]
    assert all(abs(a - truncation.top_p) < 1e-5 for a in above), above
    assert len(above) <= 2
    # it cuts, and keeps something
    assert kept.sum(dim=1).min() >= 1 and kept.sum(dim=1).max() < vocab
    # the log-probs over the set are the sampler's (transformers' log-softmax of the warped scores)
    logprob, _ = token_logprobs_and_entropy(
        logits, drawn, temperature=temperature, truncation=truncation
    )
    sampler = torch.log_softmax(warped, dim=-1).gather(1, drawn[:, None]).squeeze(1)
    same = ~differ.any(dim=1)
    torch.testing.assert_close(logprob[same], sampler[same], rtol=0, atol=2e-6)
    # a row with one token more or less: that token's mass
    assert (logprob - sampler).abs().max() < 1e-3


def _mass_above(row: torch.Tensor, temperature: float, truncation: Truncation, token: int) -> float:
    """In float64: the mass strictly above ``token`` in the distribution of ``row`` (V,) over its
    top-k set (the criterion of top-p)."""
    scores = row.double() / temperature
    if truncation.top_k:
        scores = scores.masked_fill(
            scores < scores.topk(truncation.top_k).values[-1], float("-inf")
        )
    return torch.softmax(scores, dim=0)[scores > scores[token]].sum().item()


def test_the_sampled_token_is_always_in_the_set():
    logits = _rows(8, 50, 2.0, seed=3)
    outside = logits.argmin(dim=1)  # never in the top 3
    keep = support_mask(logits, outside, 1.0, Truncation(top_k=3))
    assert keep.sum(dim=1).tolist() == [4] * 8 and keep.gather(1, outside[:, None]).all()
    logprob, entropy = token_logprobs_and_entropy(logits, outside, truncation=Truncation(top_k=3))
    assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()


def test_ties_at_the_cut_are_kept_together():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])
    keep = support_mask(logits, torch.tensor([0]), 1.0, Truncation(top_k=2))
    assert keep.tolist() == [[True, True, True, True, False]]


def test_nothing_cut_is_the_whole_vocabulary():
    logits = _rows(4, 30, 1.0, seed=4)
    assert support_mask(logits, torch.zeros(4, dtype=torch.long), 0.5, NO_TRUNCATION).all()
    # k >= V cuts nothing
    assert support_threshold(logits, 1.0, Truncation(top_k=30)).isneginf().all()
    assert (
        not Truncation(top_k=30).cuts(30)
        and Truncation(top_k=29).cuts(30)
        and Truncation(top_p=0.99).cuts(30)
    )


def test_a_nan_logit_stays_in_and_reaches_the_log_prob():
    # the NaN guard (grpo_ds.train) needs a broken forward to give a non-finite loss, with or
    # without truncation
    logits = _rows(2, 20, 1.0, seed=5)
    logits[0, 7] = float("nan")
    logprob, _ = token_logprobs_and_entropy(
        logits, torch.tensor([3, 3]), truncation=Truncation(top_k=4)
    )
    assert logprob[0].isnan() and logprob[1].isfinite()


def test_whole_vocabulary_ratios_carry_the_kept_mass():
    """The bug this replay fixes, in closed form: pi_full(y) / pi_S(y) = Z_S / Z, the mass the
    truncation kept at that position, whatever token y was drawn."""
    logits, temperature, truncation = _rows(32, 105, 1.0, seed=6), 1.5, Truncation(top_k=3)
    drawn = torch.multinomial(
        torch.softmax(_warped(logits, temperature, truncation), dim=-1),
        1,
        generator=torch.Generator().manual_seed(2),
    ).squeeze(1)
    over_set, _ = token_logprobs_and_entropy(
        logits, drawn, temperature=temperature, truncation=truncation
    )
    whole, _ = token_logprobs_and_entropy(logits, drawn, temperature=temperature)
    probs = torch.softmax(logits / temperature, dim=-1)
    mass = torch.where(support_mask(logits, drawn, temperature, truncation), probs, 0.0).sum(dim=1)
    torch.testing.assert_close((whole - over_set).exp(), mass, rtol=1e-5, atol=0)
    assert mass.mean() < 0.2  # near-uniform rows over 105 tokens: 3 of them hold about a tenth


def test_settings_are_checked():
    with pytest.raises(ValueError, match="top_k"):
        Truncation(top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        Truncation(top_p=0.0)
