"""From sample ids to one micro-batch's tensors, on the flat token layout.

A training sequence is prompt + response with no padding inside it. The model sees the micro-batch's
sequences in one of two layouts:

    packed (the default)  whole sequences concatenated in a row, ``position_ids`` restarting at 0
                          per sequence, no attention mask; transformers then keeps each sequence's
                          attention to itself. With flash attention all of them go into one row and
                          flash attention takes the sequence boundaries (``cu_seq_lens_*`` /
                          ``max_length_*``: no mask is built). Eager and sdpa build a block-diagonal
                          causal mask over the whole row and attend over all of it, at a cost that
                          grows as the row's length squared, so for them the sequences are packed
                          first-fit-decreasing into rows as wide as the longest one: never more
                          positions, nor more attention, than the padded layout, and the short
                          sequences share rows instead of padding them. A row's unused end is a
                          segment of its own (pad tokens, positions from 0) that no sequence sees.
                          When no two sequences fit in one row (all of nearly the same length),
                          packing would save nothing and still cost the block-diagonal mask: such a
                          micro-batch takes the padded layout The forward must be called with
                          ``use_cache=False``: with a cache transformers does not look for packed
                          sequences and the tokens of one sequence attend to the ones before it
                          (tests/step/test_micro_batch.py)
    padded                one row per sequence, right-padded to the longest, with an attention mask

Everything the loss needs is per trained token, flat over the micro-batch, the same in both layouts:

    target_ids   (N,)  the response token
    logit_index  (N,)  where, in the model's flattened output positions, its predicting logits are:
                       response token t of a sequence with P prompt tokens that starts at position o
                       is predicted at o + P + t - 1
    seq_index    (N,)  which sample of ``sample_ids`` it belongs to
    col          (N,)  its position within its response
    loss_mask    (N,)  1.0 for a token the model sampled, 0.0 for an environment observation token

so the loss never depends on the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_ds.rollout.base import Rollouts


@dataclass
class MicroBatch:
    sample_ids: list[int]
    input_ids: torch.Tensor  # (rows, width): packed rows, or one padded row per sequence
    attention_mask: torch.Tensor | None  # padded: (B, T); packed: None
    # packed: (rows, width), restarting per sequence; padded: None
    position_ids: torch.Tensor | None
    target_ids: torch.Tensor  # (N,)
    logit_index: torch.Tensor  # (N,) into the flattened output positions
    seq_index: torch.Tensor  # (N,) into sample_ids
    col: torch.Tensor  # (N,) position within the response
    loss_mask: torch.Tensor  # (N,) float32
    sequence_tokens: int  # prompt + response tokens the model reads (no padding)
    # a stand-in that every rank must run (ZeRO-3's collectives) but that trains nothing
    padding: bool = False
    # packed into one row: flash attention's cu_seq_lens_q/k and max_length_q/k
    boundaries: dict | None = None
    # packed: (rows, width) 1 where a sequence's token is, 0 in a row's unused end
    filled: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.target_ids.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)

    @property
    def token_mask(self) -> torch.Tensor:
        """(rows, width) 1 where the model reads a sequence's token, 0 for padding (a padded row's
        end, a packed row's unused end): the rows a per-forward statistic such as an MoE router's
        load balance counts."""
        return self.attention_mask if self.attention_mask is not None else self.filled

    def model_inputs(self) -> dict:
        """The keyword arguments of the model's forward (always without a KV cache: see the module
        docstring)."""
        inputs = {"input_ids": self.input_ids, "use_cache": False}
        if self.position_ids is None:
            inputs["attention_mask"] = self.attention_mask
        else:
            inputs.update(position_ids=self.position_ids, **(self.boundaries or {}))
        return inputs


def collate(
    rollouts: Rollouts,
    sample_ids: list[int],
    pad_id: int,
    device: torch.device,
    padding: bool = False,
    packed: bool = True,
    one_row: bool = False,
) -> MicroBatch:
    """The micro-batch of ``sample_ids`` in the packed or the padded layout (``padding``: it stands
    in for an empty micro-batch and trains nothing; ``one_row``: pack every sequence into a single
    row, for flash attention)."""
    seqs = [rollouts.prompt_ids[s] + rollouts.response_ids[s] for s in sample_ids]
    lengths = [len(s) for s in seqs]
    rows, width, packed = _layout(lengths, packed, one_row)
    tokens, positions, starts = _place(seqs, rows, width, pad_id, packed)
    input_ids = torch.tensor(tokens, dtype=torch.long).view(len(rows), width)
    index, col, seq, loss_mask = [], [], [], []
    for b, sid in enumerate(sample_ids):
        p, r = len(rollouts.prompt_ids[sid]), len(rollouts.response_ids[sid])
        index += range(starts[b] + p - 1, starts[b] + p + r - 1)
        col += range(r)
        seq += [b] * r
        loss_mask += rollouts.token_loss_mask(sid)
    logit_index = torch.tensor(index, dtype=torch.long)
    targets = input_ids.view(-1)[logit_index + 1]  # the token after each predicting position
    attention_mask = position_ids = boundaries = filled = None
    if packed:
        position_ids = torch.tensor(positions, dtype=torch.long).view(len(rows), width).to(device)
        filled = torch.zeros(len(rows) * width, dtype=torch.long)
        for b in range(len(seqs)):
            filled[starts[b] : starts[b] + lengths[b]] = 1
        if one_row:
            boundaries = _boundaries(lengths, device)
    else:
        attention_mask = (
            (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
        )
    return MicroBatch(
        sample_ids=list(sample_ids),
        input_ids=input_ids.to(device),
        attention_mask=attention_mask,
        position_ids=position_ids,
        target_ids=targets.to(device),
        logit_index=logit_index.to(device),
        seq_index=torch.tensor(seq, dtype=torch.long).to(device),
        col=torch.tensor(col, dtype=torch.long).to(device),
        loss_mask=torch.tensor(loss_mask, dtype=torch.float32).to(device),
        sequence_tokens=sum(lengths),
        padding=padding,
        boundaries=boundaries,
        filled=None if filled is None else filled.view(len(rows), width).to(device),
    )


def _layout(lengths: list[int], packed: bool, one_row: bool) -> tuple[list[list[int]], int, bool]:
    """Which sequences share each row, the row width, and whether the layout is packed (a packing
    where no two sequences share a row is the padded layout: the same model work, without the
    mask)."""
    if not packed:
        return [[b] for b in range(len(lengths))], max(lengths), False
    if one_row:
        return [list(range(len(lengths)))], sum(lengths), True
    width = max(lengths)
    rows = _rows_first_fit(lengths, width)
    if len(rows) == len(lengths):
        return [[b] for b in range(len(lengths))], width, False
    return rows, width, True


def _place(
    seqs: list[list[int]], rows: list[list[int]], width: int, pad_id: int, packed: bool
) -> tuple[list[int], list[int] | None, list[int]]:
    """The flat tokens of the rows, their position ids (packed: each sequence counts from 0, and so
    does a row's unused end) and each sequence's flat start. Built as Python lists and turned into
    tensors once (a tensor per sequence cost ~6 ms per 400 sequences)."""
    tokens = [pad_id] * (len(rows) * width)
    positions = [0] * len(tokens) if packed else None
    starts = [0] * len(seqs)  # flat position of each sequence's first token
    for r, members in enumerate(rows):
        offset = r * width
        for b in members:
            n = len(seqs[b])
            starts[b] = offset
            tokens[offset : offset + n] = seqs[b]
            if packed:
                positions[offset : offset + n] = range(n)
            offset += n
        if packed:
            positions[offset : (r + 1) * width] = range((r + 1) * width - offset)  # the unused end
    return tokens, positions, starts


def _boundaries(lengths: list[int], device: torch.device) -> dict:
    """Flash attention's sequence boundaries of a single packed row."""
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def _rows_first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices grouped into rows of ``width`` tokens, longest first (first-fit
    decreasing)."""
    # not even the two shortest share a row
    if len(lengths) > 1 and sum(sorted(lengths)[:2]) > width:
        return [[b] for b in range(len(lengths))]
    rows, room = [], []
    for b in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[b] <= free:
                rows[r].append(b)
                room[r] -= lengths[b]
                break
        else:
            rows.append([b])
            room.append(width - lengths[b])
    return rows


def split_per_sample(values: torch.Tensor, mb: MicroBatch) -> dict[int, torch.Tensor]:
    """Flat per-token values (N,) -> {sample id: its tokens' values in response order, float32 on
    CPU} (a sequence-parallel rank has some of a sample's tokens: its slice)."""
    values = values.detach().float().cpu()
    seq, col = mb.seq_index.cpu(), mb.col.cpu()
    out = {}
    for b, sid in enumerate(mb.sample_ids):
        mine = seq == b
        out[sid] = values[mine][torch.argsort(col[mine])]
    return out


def gather_per_token(
    per_sample: dict[int, torch.Tensor] | None, mb: MicroBatch
) -> torch.Tensor | None:
    """{sample id: (L_i,) per response token} -> the micro-batch's flat (N,) tensor (None stays
    None)."""
    if per_sample is None:
        return None
    return per_token([per_sample[s] for s in mb.sample_ids], mb)


def per_token(per_sequence: list, mb: MicroBatch) -> torch.Tensor:
    """Each micro-batch sequence's per-response-token values (tensors or lists, in sample order) ->
    (N,) float32 for the micro-batch's tokens, picked by (sequence, column): the same in every
    layout and shard."""
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in per_sequence])
    starts = torch.tensor([0, *[len(v) for v in per_sequence]]).cumsum(0)[:-1]
    return flat[(starts.to(mb.seq_index.device)[mb.seq_index] + mb.col).cpu()].to(
        mb.target_ids.device
    )


def as_sequence_rows(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Flat (N,) -> (S, R) with R the longest response, zeros after each response (for the
    masked-loss kernel)."""
    width = int(mb.col.max()) + 1 if mb.num_tokens else 0
    out = values.new_zeros((mb.num_sequences, width))
    return out.index_put((mb.seq_index, mb.col), values)


def shard_sequences(mb: MicroBatch, rows: int, rank: int, sp_size: int, pad_id: int) -> MicroBatch:
    """Sequence parallelism (grpo_ds.model.sequence_parallel): this rank's slice of a padded
    micro-batch (grpo_ds.step.micro_batch, ``packed=False``): ``rows`` rows, columns [rank L,
    (rank + 1) L) with L = T / sp after padding T to a multiple of sp, and the response tokens whose
    predicting position falls in it."""
    if mb.attention_mask is None:
        raise ValueError(
            "sequence parallelism shards padded micro-batches (packed rows need attention masks)"
        )
    b, t = mb.input_ids.shape
    if b > rows:
        raise ValueError(
            f"a micro-batch of {b} rows; the sequence-parallel wrapper was built for {rows}"
        )
    local = math.ceil(t / sp_size)
    lo = rank * local
    ids = torch.full(
        (rows, local * sp_size), pad_id, dtype=mb.input_ids.dtype, device=mb.input_ids.device
    )
    ids[:b, :t] = mb.input_ids
    mask = torch.zeros_like(ids)
    mask[:b, :t] = mb.attention_mask
    positions = torch.arange(local * sp_size, device=ids.device).expand(rows, -1)
    row, position = mb.logit_index // t, mb.logit_index % t
    mine = (position >= lo) & (position < lo + local)  # (N,) the tokens this rank scores
    return MicroBatch(
        sample_ids=mb.sample_ids,
        input_ids=ids[:, lo : lo + local].contiguous(),
        attention_mask=None,
        position_ids=positions[:, lo : lo + local].contiguous(),
        target_ids=mb.target_ids[mine],
        logit_index=row[mine] * local + position[mine] - lo,
        seq_index=mb.seq_index[mine],
        col=mb.col[mine],
        loss_mask=mb.loss_mask[mine],
        sequence_tokens=int(mask[:, lo : lo + local].sum()),
        padding=mb.padding,
        filled=mask[:, lo : lo + local].contiguous(),
    )
