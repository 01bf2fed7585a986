"""The sampler's set of each row (grpo_ds.algo.truncation) found without sorting the vocabulary.

Every path of the per-token math keeps a token v of a row when not logits_v < threshold (or v is the sampled token),
so one number per row carries the set. ``thresholds`` finds it for one chunk of rows, in the units of the scores it is
given (raw logits for the Triton kernels, which compare before scaling; scaled float32 rows for the PyTorch path):

- top-k: the k-th largest score of the row (``torch.topk``), ties included;
- top-p: the cut is found among a few candidates, the row's largest scores in order (with top-k: its k tokens,
  exactly). A row's candidates decide its cut when one of them falls outside the set: the mass above it reaches p.
  Rows whose first 64 candidates do not, try 1,024; rows that still do not (a flat distribution, where 1,024 tokens
  hold under p of the mass) sort their whole row, a block of rows at a time. The probabilities come from the
  row's log-sum-exp over the top-k set (over the whole row without top-k, an extra pass over it).

Working memory: the candidates (rows x at most 1,024) and, for the log-sum-exp and a sort, a block of at most
``_ROWS_AT_ONCE`` rows (a sort's float32 values and int64 indices: 15 MiB at 151,936 tokens), never (rows x
vocabulary) beyond the chunk itself.
"""

from __future__ import annotations

import torch

from grpo_ds.algo.truncation import Truncation

CANDIDATES = (64, 1024)  # the top-p candidates tried before a row's full sort
_ROWS_AT_ONCE = 8  # rows per float32 block of the log-sum-exp and of the full-row sort (values and indices)


def thresholds(scores: torch.Tensor, temperature: float, truncation: Truncation) -> torch.Tensor:
    """(c,) float32 per row of ``scores`` (c, V): its smallest kept score, in the units of ``scores`` (which are
    logits x 1/``temperature`` away from the sampler's); -inf where ``truncation`` cuts nothing."""
    rows, vocab = scores.shape
    none = torch.full((rows,), float("-inf"), dtype=torch.float32, device=scores.device)
    if not truncation.cuts(vocab) or rows == 0:
        return none
    scores = scores.detach()
    top_k = truncation.top_k if 0 < truncation.top_k < vocab else 0
    if truncation.top_p >= 1.0:
        return scores.topk(top_k, dim=1).values[:, -1].float().contiguous()  # the kernels read it as an array
    if top_k:
        values = scores.topk(top_k, dim=1).values.float()  # (c, k) descending
        tied = (~(scores < values[:, -1:])).sum(dim=1) - top_k  # (c,) tokens beyond k with the k-th score
        scaled = values / temperature
        lse = torch.logaddexp(scaled.logsumexp(dim=1), torch.log(tied.float()) + scaled[:, -1])  # (c,) over K
        cut, _ = _cut(values, lse, temperature, truncation.top_p)
        return cut  # the candidates are the whole top-k set: every row's cut is among them
    lse = _row_logsumexp(scores, temperature)  # (c,)
    found = none.clone()
    pending = torch.arange(rows, device=scores.device)
    for count in CANDIDATES:
        if count >= vocab or pending.numel() == 0:
            break
        values = scores[pending].topk(count, dim=1).values.float()  # (r, count)
        cut, inside = _cut(values, lse[pending], temperature, truncation.top_p)
        found[pending[inside]] = cut[inside]
        pending = pending[~inside]
    for block in pending.split(_ROWS_AT_ONCE) if pending.numel() else ():  # the fallback: these rows, sorted
        values = scores[block].float().sort(dim=1, descending=True).values  # (b, V)
        found[block] = _cut(values, lse[block], temperature, truncation.top_p)[0]
    return found


def _cut(values: torch.Tensor, lse: torch.Tensor, temperature: float, top_p: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last kept of each row's descending ``values`` (r, m), whether that cut is inside them: a later candidate
    is left out, so the candidates beyond m cannot matter). ``lse`` (r,): the set's log-sum-exp of the scaled
    scores."""
    q = torch.exp(values / temperature - lse[:, None])  # (r, m) probabilities over the set, descending
    above = torch.cumsum(q, dim=1) - q  # (r, m) the mass before each candidate
    kept = (above < top_p).sum(dim=1).clamp(min=1)  # (r,) a prefix: the mass above only grows
    return values.gather(1, (kept - 1)[:, None]).squeeze(1), kept < values.shape[1]


def _row_logsumexp(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c,) logsumexp(scores / temperature) per row, in float32, a block of rows at a time."""
    return torch.cat([(block.float() / temperature).logsumexp(dim=1) for block in scores.split(_ROWS_AT_ONCE)])
