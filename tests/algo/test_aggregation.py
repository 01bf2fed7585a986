import random

import pytest
import torch

from grpo_ds.algo.aggregation import aggregate, sequence_weights
from grpo_ds.algo.names import LOSS_AGG_MODES

# Hand example, three sequences (padding positions hold NaN to prove they are never read):
#   seq 0: L=2, losses [1, 2]     sum 3
#   seq 1: L=1, losses [4]        sum 4
#   seq 2: L=3, losses [1, 1, 4]  sum 6
# N = 3, T = 6, C = 4.
#   token-mean              (3 + 4 + 6) / 6          = 13/6  = 2.1666667
#   seq-mean-token-mean     (3/2 + 4/1 + 6/3) / 3    = 7.5/3 = 2.5
#   seq-mean-token-sum      (3 + 4 + 6) / 3          = 13/3  = 4.3333333
#   seq-mean-token-sum-norm (3 + 4 + 6) / (3 * 4)    = 13/12 = 1.0833333
# Results are float32 sums of a few small numbers, exact to a few ulp, so float32 defaults of
# assert_close (rtol 1.3e-6, atol 1e-5) apply; float64 weights are compared at float64 defaults
# (rtol 1e-7).
NAN = float("nan")
PER_TOKEN = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN], [1.0, 1.0, 4.0]])  # (N, T)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])  # (N, T)
EXPECTED = {
    "token-mean": 2.1666667,
    "seq-mean-token-mean": 2.5,
    "seq-mean-token-sum": 4.3333333,
    "seq-mean-token-sum-norm": 1.0833333,
}


def test_modes_listed():
    assert set(LOSS_AGG_MODES) == set(EXPECTED)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_hand_example(mode):
    out = aggregate(PER_TOKEN, MASK, mode, norm_tokens=4)
    assert out.dim() == 0 and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(EXPECTED[mode]))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # lengths [2, 1, 3, 0]: N = 3 (the empty sequence is not counted), T = 6, C = 4.
        ("token-mean", [1 / 6, 1 / 6, 1 / 6, 0.0]),
        ("seq-mean-token-mean", [1 / 6, 1 / 3, 1 / 9, 0.0]),  # 1 / (N * L_i)
        ("seq-mean-token-sum", [1 / 3, 1 / 3, 1 / 3, 0.0]),
        ("seq-mean-token-sum-norm", [1 / 12, 1 / 12, 1 / 12, 0.0]),
    ],
)
def test_weights_with_empty_sequence(mode, expected):
    w = sequence_weights([2, 1, 3, 0], mode, norm_tokens=4)
    assert w.dtype == torch.float64
    assert bool(torch.isfinite(w).all())
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    # A tensor of lengths gives the same weights as a list.
    torch.testing.assert_close(sequence_weights(torch.tensor([2, 1, 3, 0]), mode, 4), w)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_sequence_and_padding_rows_do_not_change_loss(mode):
    per_token = torch.cat([PER_TOKEN, torch.full((2, 3), NAN)])  # (N + 2, T): two all-padding rows
    mask = torch.cat([MASK, torch.zeros(2, 3, dtype=MASK.dtype)])  # (N + 2, T)
    out = aggregate(per_token, mask, mode, norm_tokens=4)
    torch.testing.assert_close(out, torch.tensor(EXPECTED[mode]))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_empty_gives_zero(mode):
    assert torch.equal(sequence_weights([0, 0], mode, 4), torch.zeros(2, dtype=torch.float64))
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode, 4).item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_split_into_ranks_and_micro_batches_sums_to_the_same_loss(mode, seed):
    # A global mini-batch of 11 sequences with uneven lengths (one empty) is dealt out to 3 "ranks"
    # unevenly, each rank cuts its share into micro-batches of random sizes and pads each
    # micro-batch only to its own longest sequence. Each micro-batch contributes sum_{i in mb} w_i
    # sum_t l_it with w from the GLOBAL lengths; the partial terms must add up to aggregate() over
    # the whole batch, and so must the gradients.
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(1, 9) for _ in range(10)] + [0]
    rng.shuffle(lengths)
    # per-token losses per sequence
    seqs = [torch.randn(n, generator=gen, dtype=torch.float64) for n in lengths]

    width = max(lengths)
    per_token = torch.zeros(len(seqs), width, dtype=torch.float64)  # (N, T)
    mask = torch.zeros(len(seqs), width)  # (N, T)
    for i, s in enumerate(seqs):
        per_token[i, : len(s)] = s
        mask[i, : len(s)] = 1
    per_token.requires_grad_(True)
    whole = aggregate(per_token, mask, mode, norm_tokens=16)
    whole.backward()

    weights = sequence_weights(lengths, mode, norm_tokens=16)  # (N,) from the global lengths
    order = list(range(len(seqs)))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), 2))
    ranks = [order[: cuts[0]], order[cuts[0] : cuts[1]], order[cuts[1] :]]
    leaves = [s.clone().requires_grad_(True) for s in seqs]
    total = torch.zeros((), dtype=torch.float64)
    n_micro = 0
    for rank in ranks:
        start = 0
        while start < len(rank):
            micro = rank[start : start + rng.randint(1, 3)]
            start += len(micro)
            n_micro += 1
            mb_width = max(1, max(lengths[i] for i in micro))
            # (n, t) padding = garbage
            mb = torch.full((len(micro), mb_width), 1e9, dtype=torch.float64)
            mb_mask = torch.zeros(len(micro), mb_width, dtype=torch.bool)  # (n, t)
            rows = []
            for j, i in enumerate(micro):
                mb_mask[j, : lengths[i]] = True
                rows.append(torch.cat([leaves[i], mb[j, lengths[i] :]]))
            mb = torch.stack(rows)  # (n, t), differentiable w.r.t. the sequences' leaves
            seq_sums = torch.where(mb_mask, mb, 0.0).sum(dim=-1)  # (n,)
            total = total + (weights[micro] * seq_sums).sum()
    assert n_micro > 3  # the split really was a split
    total.backward()

    # float64 sums of ~50 terms of order 1 in different orders: differences ~1e-15, far under rtol
    # 1e-7.
    torch.testing.assert_close(total.detach(), whole.detach())
    for i, leaf in enumerate(leaves):
        torch.testing.assert_close(leaf.grad, per_token.grad[i, : lengths[i]])


def test_local_mean_would_differ():
    # Guards the test above against being vacuous: averaging per-micro-batch token means is NOT the
    # global token-mean. Micro-batch {0, 2}: (3 + 6) / 5 = 1.8; micro-batch {1}: 4 / 1 = 4; average
    # 2.9 != 13/6.
    mb_a = aggregate(PER_TOKEN[[0, 2]], MASK[[0, 2]], "token-mean", 4)
    mb_b = aggregate(PER_TOKEN[[1]], MASK[[1]], "token-mean", 4)
    torch.testing.assert_close((mb_a + mb_b) / 2, torch.tensor(2.9))
    assert abs(2.9 - EXPECTED["token-mean"]) > 0.5


def test_gradient_is_weight_per_token():
    # token-mean: every response token gets d loss / d l_it = 1/T = 1/6; padding positions get 0.
    per_token = torch.where(MASK.bool(), PER_TOKEN, 0.0).requires_grad_(True)
    aggregate(per_token, MASK, "token-mean", 4).backward()
    torch.testing.assert_close(per_token.grad, MASK.float() / 6)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'token_mean'"):
        sequence_weights([1, 2], "token_mean", 4)
    with pytest.raises(ValueError, match="norm_tokens"):
        sequence_weights([1, 2], "seq-mean-token-sum-norm", 0)
    with pytest.raises(ValueError, match=">= 0"):
        sequence_weights([1, -2], "token-mean", 4)
    with pytest.raises(ValueError, match=r"\(N, T\)"):
        aggregate(torch.zeros(2, 3), torch.zeros(2, 4), "token-mean", 4)
