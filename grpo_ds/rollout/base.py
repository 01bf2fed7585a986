"""The rollout-engine protocol and the data it returns.

An engine turns prompt token ids into ``group_size`` sampled completions each, and receives new
weights after every optimizer step. ``hf`` (transformers generate) is the CPU/default engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0


@dataclass
class Rollouts:
    """One flat batch of completions; the G completions of a prompt are consecutive.

    prompt_ids[i] / response_ids[i]: token ids of sample i, without padding; response_ids ends with EOS
    when finish_reason[i] == "stop". sampler_logprobs[i][t] is log p(response_ids[i][t]) under the
    distribution actually sampled from (temperature, top-p, top-k applied).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    finish_reason: list[str]  # "stop" (EOS) | "length" (hit max_new_tokens)

    def __len__(self) -> int:
        return len(self.response_ids)

    def response_mask(self) -> torch.Tensor:
        """(N, max response length) 1 for real response tokens, 0 for padding."""
        width = max((len(r) for r in self.response_ids), default=0)
        mask = torch.zeros(len(self), width, dtype=torch.int64)
        for i, r in enumerate(self.response_ids):
            mask[i, : len(r)] = 1
        return mask

    @staticmethod
    def concat(parts: Iterable[Rollouts]) -> Rollouts:
        parts = list(parts)
        return Rollouts(*[sum((getattr(p, f) for p in parts), []) for f in
                          ("prompt_ids", "response_ids", "sampler_logprobs", "finish_reason")])


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams) -> Rollouts: ...

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights in; return how many tensors were updated."""
        ...
