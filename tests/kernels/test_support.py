"""grpo_ds.kernels.support: each row's threshold of the sampler's set, found from a few candidates,
is the reference's (grpo_ds.algo.truncation, a full sort), and a row is sorted whole only when its
candidates cannot decide."""

import pytest
import torch

from grpo_ds.algo.truncation import Truncation, support_threshold
from grpo_ds.kernels import support


@pytest.fixture
def sorts(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes every Tensor.sort is called with (the fallback's whole-row sorts)."""
    seen: list[tuple[int, ...]] = []
    real = torch.Tensor.sort

    def sort(self, *args, **kwargs):
        seen.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", sort)
    return seen


def _rows(n: int, vocab: int, scale: float, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (scale * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize(
    ("temperature", "truncation"),
    [
        (1.0, Truncation(top_k=20)),
        (0.7, Truncation(top_k=5, top_p=0.7)),
        (1.3, Truncation(top_k=40, top_p=0.95)),
        (1.0, Truncation(top_p=0.5)),
        (0.6, Truncation(top_p=0.9)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_peaked_rows_are_decided_by_their_candidates(sorts, temperature, truncation, dtype):
    """Language-model-like rows (std 3 over 20,000 tokens): the first 64 candidates (or the top-k
    set) hold the cut, nothing is sorted, and the threshold is the reference's exactly, in the
    logits' own units (bf16 included)."""
    logits = _rows(16, 20_000, 3.0, dtype=dtype)
    expected = support_threshold(logits, temperature, truncation)  # the reference sorts every row
    sorts.clear()
    got = support.thresholds(logits, temperature, truncation)
    assert not sorts
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, expected)


def test_flat_rows_try_more_candidates_then_sort_whole_rows(sorts):
    """Rows whose top 64 hold under top_p of the mass try 1,024 candidates; rows where those do not
    either (a flat distribution) are sorted whole, only they, a block of rows at a time."""
    plateau = 0.01 * _rows(3, 5000, 1.0, seed=2)
    # 300 tokens hold 96% of the mass: more than 64, fewer than 1,024 candidates
    plateau[:, :300] += 6.0
    logits = torch.cat(
        [
            _rows(3, 5000, 3.0, seed=1),  # peaked: 64 candidates decide
            plateau,  # 1,024 do
            0.01 * _rows(2, 5000, 1.0, seed=3),
        ]
    )  # flat: sorted
    truncation = Truncation(top_p=0.9)
    expected = support_threshold(logits, 1.0, truncation)
    sorts.clear()
    got = support.thresholds(logits, 1.0, truncation)
    assert sorts == [(2, 5000)]
    assert torch.equal(got, expected)


def test_ties_beyond_the_kth_token_count_in_the_mass():
    # k = 2 with the 2nd to 4th scores tied: the top-k set holds 4 tokens, and top-p is taken over
    # them
    logits = torch.tensor([[4.0, 3.0, 3.0, 3.0, 0.0, -1.0]])
    truncation = Truncation(top_k=2, top_p=0.6)
    assert torch.equal(
        support.thresholds(logits, 1.0, truncation), support_threshold(logits, 1.0, truncation)
    )
    assert support.thresholds(logits, 1.0, truncation).item() == 3.0


def test_small_vocabularies_and_no_cut():
    logits = _rows(5, 40, 1.0)  # fewer tokens than the first candidates
    for truncation in (Truncation(top_p=0.3), Truncation(top_k=7, top_p=0.8), Truncation(top_k=39)):
        assert torch.equal(
            support.thresholds(logits, 1.2, truncation), support_threshold(logits, 1.2, truncation)
        )
    assert support.thresholds(logits, 1.0, Truncation(top_k=40)).isneginf().all()
    assert support.thresholds(logits[:0], 1.0, Truncation(top_k=3)).shape == (0,)
