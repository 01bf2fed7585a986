"""The sampler's set of each row (grpo_ds.algo.truncation) found without sorting the vocabulary.

Every path of the per-token math keeps a token v of a row when not logits_v < threshold (or v is the
sampled token), so one number per row carries the set. ``find`` finds it for one chunk of rows from
their logits (every path compares in logit units, before the temperature):

- top-k: the k-th largest logit of the row (``torch.topk`` of k + 1: the last one shows a tie with
  the k-th);
- top-p: the cut is found among a few candidates, the row's largest logits in order (with top-k: its
  k tokens, exactly). A row's candidates decide its cut when one of them falls outside the set: the
  mass above it reaches p. Rows whose first 64 candidates do not, try 1,024; rows that still do not
  (a flat distribution, where 1,024 tokens hold under p of the mass) sort their whole row, a block
  of rows at a time. The probabilities come from the row's log-sum-exp over the top-k set (over the
  whole row without top-k, an extra pass over it).

Where every row's set lies among the candidates, ``find`` returns them too: the PyTorch path's
forward then needs nothing else (grpo_ds.kernels.chunked).

Working memory: the candidates (rows x at most 1,024), a 32-row float32 block for top-p's
log-sum-exp where the logits need a copy, and an 8-row block for a sort (float32 values and int64
indices: 15 MiB at 151,936 tokens); never (rows x vocabulary) beyond the chunk itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_ds.algo.truncation import Truncation

CANDIDATES = (64, 1024)  # the top-p candidates tried before a row's full sort
# rows per block of the full-row sort (values and indices); the log-sum-exp's blocks are 4x
_ROWS_AT_ONCE = 8


class RowSets(NamedTuple):
    """The sampler's set of each row of a chunk, in the units of the scores it was found from."""

    # (c,) float32, contiguous: the smallest kept score; -inf where nothing is cut
    thresholds: torch.Tensor
    # (c, m) float32 descending scores and their token ids of candidates that hold every row's whole
    # set (the set: the candidates not below the row's threshold, and the sampled token); None where
    # some row's set reaches beyond them
    values: torch.Tensor | None = None
    indices: torch.Tensor | None = None


def find_if_cut(scores: torch.Tensor, temperature: float, truncation: Truncation) -> RowSets | None:
    """``find``, or None where ``truncation`` cuts nothing from rows of this width (the kernels then
    run their untruncated variant)."""
    return find(scores, temperature, truncation) if truncation.cuts(scores.shape[1]) else None


def thresholds(scores: torch.Tensor, temperature: float, truncation: Truncation) -> torch.Tensor:
    """(c,) float32 per row of ``scores`` (c, V): its smallest kept score (``find``)."""
    return find(scores, temperature, truncation).thresholds


def find(scores: torch.Tensor, temperature: float, truncation: Truncation) -> RowSets:
    """Each row's set of ``scores`` (c, V), in their units (logits x 1/``temperature`` away from the
    sampler's); the thresholds are -inf where ``truncation`` cuts nothing."""
    rows, vocab = scores.shape
    none = torch.full((rows,), float("-inf"), dtype=torch.float32, device=scores.device)
    if not truncation.cuts(vocab) or rows == 0:
        return RowSets(none)
    scores = scores.detach()
    top_k = truncation.top_k if 0 < truncation.top_k < vocab else 0
    if top_k:
        # (c, k + 1) descending: the k-th's tie shows in the last
        values, indices = scores.topk(top_k + 1, dim=1)
        values = values.float()
        cut = values[:, top_k - 1].contiguous()  # (c,) the top-k cut; ties with it are in K
        straddle = values[:, top_k] == cut  # (c,) K holds more than k tokens
        values, indices = values[:, :top_k], indices[:, :top_k]
        if truncation.top_p < 1.0:
            scaled = values / temperature
            lse = scaled.logsumexp(dim=1)  # (c,) over K
            # the ties beyond the k-th count in K's mass (rare: each tied token, once)
            if straddle.any():
                extra = (~(scores[straddle] < cut[straddle, None])).sum(dim=1) - top_k
                lse[straddle] = torch.logaddexp(
                    lse[straddle], torch.log(extra.float()) + scaled[straddle, -1]
                )
            # the cut is among K's first k, in order
            cut = _cut(values, lse, temperature, truncation.top_p)[0]
        # no tie beyond the candidates is in a set
        held = not bool((straddle & (values[:, -1] >= cut)).any())
        return RowSets(cut, values if held else None, indices if held else None)
    return _top_p(scores, temperature, truncation.top_p, none)


def _top_p(scores: torch.Tensor, temperature: float, top_p: float, none: torch.Tensor) -> RowSets:
    """Top-p alone: each row's cut among its 64, then 1,024 largest scores, else in its whole row,
    sorted."""
    rows, vocab = scores.shape
    lse = _row_logsumexp(scores, temperature)  # (c,)
    found = none.clone()
    # the candidates held
    values = torch.full((rows, 0), float("-inf"), dtype=torch.float32, device=scores.device)
    indices = torch.zeros((rows, 0), dtype=torch.long, device=scores.device)
    pending = torch.arange(rows, device=scores.device)
    for count in CANDIDATES:
        if count >= vocab or pending.numel() == 0:
            break
        # a gather only for the rows left
        rows_now = scores if pending.numel() == rows else scores[pending]
        top, ids = rows_now.topk(count, dim=1)  # (r, count)
        top = top.float()
        cut, inside = _cut(top, lse[pending], temperature, top_p)
        inside &= top[:, -1] < cut  # every token of the set among them, ties included
        found[pending[inside]] = cut[inside]
        grown = torch.full((rows, count), float("-inf"), dtype=torch.float32, device=scores.device)
        grown_ids = torch.zeros((rows, count), dtype=torch.long, device=scores.device)
        grown[:, : values.shape[1]], grown_ids[:, : values.shape[1]] = values, indices
        grown[pending[inside]], grown_ids[pending[inside]] = top[inside], ids[inside]
        values, indices = grown, grown_ids
        pending = pending[~inside]
    # the fallback: these rows, sorted
    for block in pending.split(_ROWS_AT_ONCE) if pending.numel() else ():
        ordered = scores[block].float().sort(dim=1, descending=True).values  # (b, V)
        found[block] = _cut(ordered, lse[block], temperature, top_p)[0]
    held = pending.numel() == 0 and values.shape[1] > 0
    return RowSets(found, values if held else None, indices if held else None)


def _cut(
    values: torch.Tensor, lse: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last kept of each row's descending ``values`` (r, m), whether that cut is inside them: a
    later candidate is left out, so the candidates beyond m cannot matter). ``lse`` (r,): the set's
    log-sum-exp of the scaled scores."""
    # (r, m) probabilities over the set, descending
    q = torch.exp(values / temperature - lse[:, None])
    above = torch.cumsum(q, dim=1) - q  # (r, m) the mass before each candidate
    kept = (above < top_p).sum(dim=1).clamp(min=1)  # (r,) a prefix: the mass above only grows
    return values.gather(1, (kept - 1)[:, None]).squeeze(1), kept < values.shape[1]


def _row_logsumexp(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c,) logsumexp(scores / temperature) per row, in float32: in one call on float32 scores at
    temperature 1, else a block of rows at a time (each block's float32 copy)."""
    if scores.dtype == torch.float32 and temperature == 1.0:
        return scores.logsumexp(dim=1)
    return torch.cat(
        [
            (block.float() / temperature).logsumexp(dim=1)
            for block in scores.split(4 * _ROWS_AT_ONCE)
        ]
    )
