"""From sample ids to one micro-batch's tensors, on the flat token layout.

A training sequence is prompt + response with no padding inside it. The model sees the micro-batch's sequences
as rows right-padded to the longest one (``input_ids``, ``attention_mask``: the model layout). Everything the loss
needs is per trained token, flat over the micro-batch:

    target_ids   (N,)  the response token
    logit_index  (N,)  where, in the model's flattened (B*T) output positions, its predicting logits are:
                       response token t of a sample with P prompt tokens is predicted at position P + t - 1
    seq_index    (N,)  which sample of ``sample_ids`` it belongs to
    col          (N,)  its position within its response
    loss_mask    (N,)  1.0 for a token the model sampled, 0.0 for an environment observation token

so the loss never depends on how the sequences are laid out for the model (rows today, packed rows later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_ds.rollout.base import Rollouts


@dataclass
class MicroBatch:
    sample_ids: list[int]
    input_ids: torch.Tensor  # (B, T) the model layout
    attention_mask: torch.Tensor  # (B, T)
    target_ids: torch.Tensor  # (N,)
    logit_index: torch.Tensor  # (N,) into the (B*T) output positions
    seq_index: torch.Tensor  # (N,) into sample_ids
    col: torch.Tensor  # (N,) position within the response
    loss_mask: torch.Tensor  # (N,) float32
    padding: bool = False  # a stand-in that every rank must run (ZeRO-3's collectives) but that trains nothing

    @property
    def num_tokens(self) -> int:
        return int(self.target_ids.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)


def collate(rollouts: Rollouts, sample_ids: list[int], pad_id: int, device: torch.device,
            padding: bool = False) -> MicroBatch:
    """The micro-batch of ``sample_ids`` (``padding``: it stands in for an empty micro-batch and trains nothing)."""
    seqs = [rollouts.prompt_ids[s] + rollouts.response_ids[s] for s in sample_ids]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    index, col, seq, loss_mask = [], [], [], []
    for b, (sid, tokens) in enumerate(zip(sample_ids, seqs, strict=True)):
        input_ids[b, : len(tokens)] = torch.tensor(tokens)
        attention_mask[b, : len(tokens)] = 1
        p, r = len(rollouts.prompt_ids[sid]), len(rollouts.response_ids[sid])
        index += range(b * width + p - 1, b * width + p + r - 1)
        col += range(r)
        seq += [b] * r
        loss_mask += rollouts.token_loss_mask(sid)
    logit_index = torch.tensor(index, dtype=torch.long)
    targets = input_ids.view(-1)[logit_index + 1]  # the token after each predicting position
    return MicroBatch(sample_ids=list(sample_ids), input_ids=input_ids.to(device),
                      attention_mask=attention_mask.to(device), target_ids=targets.to(device),
                      logit_index=logit_index.to(device), seq_index=torch.tensor(seq, dtype=torch.long).to(device),
                      col=torch.tensor(col, dtype=torch.long).to(device),
                      loss_mask=torch.tensor(loss_mask, dtype=torch.float32).to(device), padding=padding)


def split_per_sample(values: torch.Tensor, mb: MicroBatch) -> dict[int, torch.Tensor]:
    """Flat per-token values (N,) -> {sample id: (L_i,) float32 tensor on CPU}."""
    values = values.detach().float().cpu()
    seq = mb.seq_index.cpu()
    return {sid: values[seq == b] for b, sid in enumerate(mb.sample_ids)}


def gather_per_token(per_sample: dict[int, torch.Tensor] | None, mb: MicroBatch) -> torch.Tensor | None:
    """{sample id: (L_i,)} -> the micro-batch's flat (N,) tensor (None stays None)."""
    if per_sample is None:
        return None
    return torch.cat([per_sample[s] for s in mb.sample_ids]).to(mb.target_ids.device)


def as_sequence_rows(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Flat (N,) -> (S, R) with R the longest response, zeros after each response (for the masked-loss kernel)."""
    width = int(mb.col.max()) + 1 if mb.num_tokens else 0
    out = values.new_zeros((mb.num_sequences, width))
    return out.index_put((mb.seq_index, mb.col), values)
