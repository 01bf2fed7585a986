"""From sample ids to tensors, and from a model forward to per-token log-probs.

A training sequence is prompt + response with no padding inside it, right-padded to the longest
sequence of its micro-batch; the logits at position p-1 predict the token at p, so response token t of
a sample with prompt length P is scored by the logits at P + t - 1. Per-token tensors are flat over
all response tokens of the micro-batch, with ``seq_index`` saying which sample each token belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_ds.algo.logprobs import token_logprobs_and_entropy
from grpo_ds.rollout.base import Rollouts


@dataclass
class MicroBatchTensors:
    sample_ids: list[int]
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    row: torch.Tensor  # (N_tok,) batch row of each response token
    logit_pos: torch.Tensor  # (N_tok,) position whose logits predict the token
    target_ids: torch.Tensor  # (N_tok,)
    seq_index: torch.Tensor  # (N_tok,) index into sample_ids

    @property
    def num_tokens(self) -> int:
        return int(self.target_ids.numel())


def collate(rollouts: Rollouts, sample_ids: list[int], pad_id: int, device: torch.device) -> MicroBatchTensors:
    seqs = [rollouts.prompt_ids[s] + rollouts.response_ids[s] for s in sample_ids]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    row, pos, seq_index = [], [], []
    for b, (sid, seq) in enumerate(zip(sample_ids, seqs, strict=True)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        p, r = len(rollouts.prompt_ids[sid]), len(rollouts.response_ids[sid])
        row += [b] * r
        pos += list(range(p - 1, p + r - 1))
        seq_index += [b] * r
    row_t, pos_t = torch.tensor(row, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
    return MicroBatchTensors(sample_ids=list(sample_ids), input_ids=input_ids.to(device),
                             attention_mask=attention_mask.to(device), row=row_t.to(device), logit_pos=pos_t.to(device),
                             target_ids=input_ids[row_t, pos_t + 1].to(device),
                             seq_index=torch.tensor(seq_index, dtype=torch.long).to(device))


def response_logprobs(model, mb: MicroBatchTensors, temperature: float, chunk_tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) of the response tokens, each (N_tok,) float32, under softmax(logits / T)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits  # (B, T, V)
    rows = logits[mb.row, mb.logit_pos]  # (N_tok, V)
    return token_logprobs_and_entropy(rows, mb.target_ids, chunk_tokens=chunk_tokens, temperature=temperature)


def split_per_sample(values: torch.Tensor, mb: MicroBatchTensors) -> dict[int, torch.Tensor]:
    """Flat per-token values -> {sample id: (L_i,) tensor on CPU}."""
    values = values.detach().float().cpu()
    seq = mb.seq_index.cpu()
    return {sid: values[seq == b] for b, sid in enumerate(mb.sample_ids)}
