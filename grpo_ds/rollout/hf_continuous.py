"""Continuous generation on the ``hf`` engine: a running batch that groups join as others finish,
and new weights loaded between two decode steps.

The batch-by-batch engine (grpo_ds.rollout.hf) runs one ``generate`` call per batch of prompts: it
starts every row at once and returns when the longest has ended, so with long-tailed completion
lengths most of a call decodes a handful of stragglers. Here the rows of many steps share one
running batch of at most ``capacity_rows`` rows (the batch-by-batch engine's largest:
rollout.generation_batch_prompts x rollout.group_size): the schedule (grpo_ds.step.continuous)
admits a group of G rows whenever G rows are free, and each ``step`` decodes one token of every
running row.

How the batch is kept. Every row in the KV cache holds its context left-padded to the cache's
length; the attention mask marks the pads and the position ids count only the row's own tokens, so a
row's numbers do not depend on which rows run beside it (as in a left-padded ``generate``). Rows
that join are prefilled together, beside the decode step of the running rows, and their caches are
joined to the running one (the shorter left-padded); rows that end leave the cache, and columns no
row uses any more are cut. Token picking and the recorded log-probs are TokenSampler's
(grpo_ds.rollout.hf): the recipe's temperature, top-k and top-p, then one uniform number from the
row's own stream at the row's own token index (grpo_ds.rollout.streams), so a sample is the same
token for token as the batch-by-batch engine draws, whatever ran beside it.

New weights (``load_weights``) are copied in between two decode steps; nothing in flight is
finished early or dropped. The KV cache of the rows in flight was computed with the old weights and
is recomputed: every running row is prefilled again with its whole context under the new weights
before its next token. So each token is sampled from exactly pi_v(token | everything before it) for
the version v it records (``Rollouts.token_versions``), and its sampler log-prob is that
distribution's, which is what the trainer's importance weight divides by. (vLLM's pause-keep-resume
keeps its cache instead: there the prefix's keys and values stay those of the old weights.) The
recompute costs one prefill of the rows in flight per weight update, about one decode step's worth
of model calls per context token, once per optimizer step.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from grpo_ds.rollout.base import Rollouts, SamplingParams
from grpo_ds.rollout.hf_sampling import (
    check_model_warpers,
    eval_mode,
    left_padded,
    sample_tokens,
    sampling_warpers,
)
from grpo_ds.rollout.streams import RowStreams


@dataclass(frozen=True)
class GroupRequest:
    """``size`` samples of one prompt, as a step admits them: sample k is keyed
    (``sampling.first_prompt`` * size + k) in the stream of ``sampling.seed``, as the batch-by-batch
    engine keys it (its place in the step's batch)."""

    step: int
    group: int  # the group's place in the step's batch
    prompt_ids: list[int]
    size: int
    sampling: SamplingParams  # the step's, with first_prompt = group


@dataclass
class FinishedGroup:
    step: int
    group: int
    rollouts: Rollouts  # its ``size`` samples in order, with their token versions


@dataclass
class DrawnSample:
    """One sample of a group in flight: its tokens so far, their log-probs and weight versions."""

    request: GroupRequest
    sample: int  # k within the group
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once ended

    @property
    def context(self) -> list[int]:
        return list(self.request.prompt_ids) + self.ids


class GroupsInFlight:
    """The groups a running batch holds (both engines'), each until its last sample ends."""

    def __init__(self) -> None:
        self._samples: dict[tuple[int, int], list[DrawnSample]] = {}

    def admit(self, request: GroupRequest, free_rows: int) -> list[DrawnSample]:
        """``request``'s samples, with room for them (``free_rows``) or ValueError."""
        if request.size > free_rows:
            raise ValueError(f"{request.size} rows admitted with {free_rows} free")
        samples = [DrawnSample(request, k) for k in range(request.size)]
        self._samples[(request.step, request.group)] = samples
        return samples

    def ended(self, sample: DrawnSample) -> list[FinishedGroup]:
        """``sample`` has ended: its group, as Rollouts in sample order, if it was the last."""
        request = sample.request
        key = (request.step, request.group)
        samples = self._samples[key]
        if any(s.finish is None for s in samples):
            return []
        del self._samples[key]
        rollouts = Rollouts(
            [list(request.prompt_ids) for _ in samples],
            [s.ids for s in samples],
            [s.logprobs for s in samples],
            [s.finish for s in samples],
            token_versions=[s.versions for s in samples],
        ).drawn_with(request.sampling.settings)
        return [FinishedGroup(request.step, request.group, rollouts)]


class ContinuousDecoder:
    """A running batch of at most ``capacity_rows`` rows on ``model``; ``version``: the weight
    version the model holds now."""

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        stop_ids: Sequence[int],
        capacity_rows: int,
        version: int = 0,
    ) -> None:
        self.model, self.pad_token_id, self.stop_ids = model, pad_token_id, tuple(stop_ids)
        self.capacity_rows, self.version = capacity_rows, version
        self.device = next(model.parameters()).device
        self._params = dict(model.named_parameters())
        # the forward's name for the KV cache it updates in place (transformers 5.2x renamed it)
        self._cache_key = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._running: list[DrawnSample] = []  # the cache's rows, in its order
        self._joining: list[
            DrawnSample
        ] = []  # prefilled at the next step (admitted, or new weights)
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (running rows, cache length) 1 = a real token
        self._streams: RowStreams | None = None  # the running rows', in the cache's order
        self._groups = GroupsInFlight()
        self._sampling: SamplingParams | None = None
        # since the last ``take_stats``: decode steps, rows decoded (tokens picked) over them
        self._stats = [0, 0]

    # ---- the batch
    @property
    def rows_in_flight(self) -> int:
        return len(self._running) + len(self._joining)

    @property
    def free_rows(self) -> int:
        return self.capacity_rows - self.rows_in_flight

    def admit(self, request: GroupRequest) -> None:
        """``request``'s rows join the batch at the next step (the caller leaves room for them)."""
        first = self._sampling
        if first is None:
            if request.sampling.temperature > 0:
                check_model_warpers(self.model)
            self._sampling = request.sampling
        elif request.sampling.settings != first.settings or (
            request.sampling.max_new_tokens != first.max_new_tokens
        ):
            raise ValueError("every group of a running batch is sampled with the same settings")
        self._joining += self._groups.admit(request, self.free_rows)

    # ---- weights
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy new weights in between two decode steps; the rows in flight go on with them from
        their next token (their cache is recomputed: the module's docstring). Returns how many
        tensors were updated."""
        count = 0
        for name, tensor in named_tensors:
            self._params[name].copy_(tensor)
            count += 1
        self.version = version
        self._joining = self._running + self._joining
        self._running, self._cache, self._mask, self._streams = [], None, None, None
        return count

    # ---- one decode step
    @torch.no_grad()
    def step(self) -> list[FinishedGroup]:
        """One token for every row in flight (the joining rows prefilled first); returns the groups
        whose every row has ended, in the order they ended."""
        if not self.rows_in_flight:
            return []
        with eval_mode(self.model):
            logits = self._forward()
        rows = self._running
        t = torch.tensor([len(r.ids) for r in rows], dtype=torch.long, device=self.device)
        tokens, taken = self._pick(logits, t)
        self._stats[0] += 1
        self._stats[1] += len(rows)
        finished: list[FinishedGroup] = []
        for row, token, logprob in zip(rows, tokens.tolist(), taken.tolist(), strict=True):
            row.ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(self.version)
            if token in self.stop_ids:
                row.finish = "stop"
            elif len(row.ids) >= self._sampling.max_new_tokens:
                row.finish = "length"
            if row.finish is not None:
                finished += self._groups.ended(row)
        self._prune()
        return finished

    def take_stats(self) -> tuple[int, int]:
        """(decode steps, rows decoded over them: the tokens picked) since the last call."""
        stats, self._stats = tuple(self._stats), [0, 0]
        return stats

    def _forward(self) -> torch.Tensor:
        """(running rows, vocabulary) float32 next-token logits; the joining rows are prefilled and
        join the running ones (after them, in the cache's order)."""
        parts = []
        if self._running:
            mask = torch.cat([self._mask, self._mask.new_ones(len(self._running), 1)], dim=1)
            last = torch.tensor([[r.ids[-1]] for r in self._running], device=self.device)
            out = self.model(
                input_ids=last,
                attention_mask=mask,
                position_ids=mask.sum(dim=1, keepdim=True) - 1,
                use_cache=True,
                **{self._cache_key: self._cache},
            )
            parts.append((out.logits[:, -1].float(), self._cache, mask))
        if self._joining:
            input_ids, mask = left_padded([r.context for r in self._joining], self.pad_token_id)
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(dim=1) - 1).masked_fill_(mask == 0, 1)
            cache = DynamicCache()
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_key: cache},
            )
            parts.append((out.logits[:, -1].float(), cache, mask))
            joined = RowStreams.joined([self._stream(r) for r in self._joining])
            self._streams = (
                joined if self._streams is None else RowStreams.joined([self._streams, joined])
            )
            self._running, self._joining = self._running + self._joining, []
        if len(parts) == 1:  # the running rows alone, or the joining ones alone: no copy
            logits, self._cache, self._mask = parts[0]
            return logits
        width = max(mask.shape[1] for *_, mask in parts)
        self._mask = torch.cat([_left_pad(mask, width) for *_, mask in parts])
        layers = [_layers(cache) for _, cache, _ in parts]
        self._cache = DynamicCache(
            [
                tuple(torch.cat([_left_pad(part[i][j], width) for part in layers]) for j in (0, 1))
                for i in range(len(layers[0]))
            ]
        )
        return torch.cat([logits for logits, *_ in parts])

    def _stream(self, row: DrawnSample) -> RowStreams:
        request = row.request
        key = request.sampling.first_prompt * request.size + row.sample
        return RowStreams(request.sampling.seed, [key], self.device)

    def _pick(self, logits: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token and its log-prob under the distribution it was drawn from: as
        TokenSampler (grpo_ds.rollout.hf), row b's number the t[b]-th of its stream."""
        scores = logits
        for warper in sampling_warpers(self._sampling):
            scores = warper(None, scores)
        logprobs = torch.log_softmax(scores, dim=-1)
        tokens = (
            scores.argmax(dim=-1, keepdim=True)
            if self._sampling.temperature <= 0
            else sample_tokens(logprobs, self._streams.uniform(t))
        )
        return tokens.squeeze(-1).cpu(), logprobs.gather(-1, tokens).squeeze(-1).cpu()

    def _prune(self) -> None:
        """Rows that ended leave the cache; so do the columns no running row uses."""
        keep = [i for i, r in enumerate(self._running) if r.finish is None]
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._mask, self._streams = None, None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._streams = self._streams.take(index)
        mask = self._mask[index]
        used = mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1]
        self._mask = mask[:, first:]
        self._cache = DynamicCache(
            [(k[index, :, first:], v[index, :, first:]) for k, v in _layers(self._cache)]
        )


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, (rows, heads, length, head size); a cache of another kind than
    full attention's (sliding window, linear attention) is refused."""
    out = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"continuous generation keeps full-attention KV caches; this model's has a "
                f"{type(layer).__name__}: set rollout.continuous to false"
            )
        out.append((layer.keys, layer.values))
    return out


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` left-padded with zeros to ``width`` along its length (a cache's dimension -2, a
    mask's last)."""
    dim = tensor.dim() - (2 if tensor.dim() == 4 else 1)
    missing = width - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
