"""The rollout-engine protocol and the data it returns.

An engine turns prompt token ids into ``group_size`` sampled completions each, and receives new
weights after every optimizer step, unless it generates with the policy's own module. ``hf``
(transformers generate) is the CPU/default engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo_ds.errors import UserError


@dataclass(frozen=True)
class SamplerSettings:
    """What a sample's tokens were drawn from: softmax(logits / temperature) cut to the ``top_k``
    most likely tokens (0 = all), then to the smallest set holding ``top_p`` of their mass (1.0 =
    all). The trainer computes its log-probs over the same set (grpo_ds.algo.truncation), so a
    sample drawn with other settings than the trainer's cannot be trained without a wrong importance
    weight: it carries these with it."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __str__(self) -> str:
        return f"temperature {self.temperature:g}, top_k {self.top_k}, top_p {self.top_p:g}"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy decoding
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0  # the step's (the same on every rank)
    # The place in the step's batch of the call's first prompt: samples are keyed by their place, so
    # they do not depend on how the step's prompts are spread over ranks (the hf engine:
    # grpo_ds.rollout.streams; vLLM: one seed per request).
    first_prompt: int = 0

    @property
    def settings(self) -> SamplerSettings:
        return SamplerSettings(self.temperature, self.top_k, self.top_p)


@dataclass
class Rollouts:
    """One flat batch of completions; the G completions of a prompt are consecutive.

    ``prompt_ids[i]`` / ``response_ids[i]``: token ids of sample i, without padding;
    ``response_ids`` ends with EOS when ``finish_reason[i] == "stop"``. ``sampler_logprobs[i][t]``
    is log p(``response_ids[i][t]``) under the distribution actually sampled from (temperature,
    top-p, top-k applied).

    Multi-turn (agent) rollouts interleave model turns with environment observations inside
    ``response_ids``: ``loss_mask[i][t]`` is 1 for a token the model sampled and 0 for an
    observation token (no gradient, not counted by loss aggregation; its sampler log-prob is 0.0).
    ``env_rewards[i]`` is the environment's reward for sample i (per-turn rewards plus the final
    one), added to the reward functions' total. Both are None for single-turn engines (every token
    is the model's; no environment reward). ``sampler_settings[i]``: what sample i was drawn with
    (``drawn_with``), None where it was not recorded (the in-flight samples of a checkpoint written
    before samples carried them). ``token_versions[i][t]``: the weight version (the optimizer step
    whose weights; 0 the initial ones) token t of sample i was sampled with, where the engine
    loads new weights while a sample is in flight (continuous generation,
    grpo_ds.rollout.hf_continuous); None where a whole batch was sampled with one version.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    # "stop" (EOS or the environment ended it) | "length" (hit a token or turn limit)
    finish_reason: list[str]
    loss_mask: list[list[int]] | None = None
    env_rewards: list[float] | None = None
    sampler_settings: list[SamplerSettings] | None = None
    token_versions: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def drawn_with(self, settings: SamplerSettings) -> Rollouts:
        """These samples, each marked as drawn with ``settings`` (an engine's last word on what it
        generated)."""
        self.sampler_settings = [settings] * len(self)
        return self

    def check_drawn_with(self, expected: SamplerSettings, where: str) -> None:
        """Refuse samples drawn with other settings than ``expected``, the trainer's: it would score
        their tokens over another set than the sampler's (grpo_ds.algo.truncation) and weight them
        wrongly."""
        other = next((s for s in self.sampler_settings or () if s != expected), None)
        if other is not None:
            raise UserError(
                where,
                f"samples drawn with {other} reached a trainer that replays {expected} (the "
                "recipe's rollout.temperature, rollout.top_k and rollout.top_p)",
                "train them with the recipe that drew them: a run's sampling settings cannot "
                "change while samples drawn with the old ones are in flight",
            )

    @staticmethod
    def from_record(record: dict) -> Rollouts:
        """The Rollouts of ``dataclasses.asdict(rollouts)`` (a checkpoint's in-flight samples)."""
        settings = record.get("sampler_settings")
        return Rollouts(
            **{
                **record,
                "sampler_settings": None
                if settings is None
                else [SamplerSettings(**s) for s in settings],
            }
        )

    def token_loss_mask(self, i: int) -> list[int]:
        """loss_mask[i], or all ones for a single-turn rollout."""
        return self.loss_mask[i] if self.loss_mask is not None else [1] * len(self.response_ids[i])

    def trained_tokens(self, i: int) -> int:
        """How many of sample i's response tokens the loss sees (its L_i in
        grpo_ds.algo.aggregation)."""
        return (
            sum(self.token_loss_mask(i))
            if self.loss_mask is not None
            else len(self.response_ids[i])
        )

    def select(self, indices: list[int]) -> Rollouts:
        """The samples at ``indices``, in that order."""

        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return Rollouts(
            pick(self.prompt_ids),
            pick(self.response_ids),
            pick(self.sampler_logprobs),
            pick(self.finish_reason),
            pick(self.loss_mask),
            pick(self.env_rewards),
            pick(self.sampler_settings),
            pick(self.token_versions),
        )

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
        out = Rollouts(
            *[
                sum((getattr(p, f) for p in parts), [])
                for f in ("prompt_ids", "response_ids", "sampler_logprobs", "finish_reason")
            ]
        )
        if any(p.loss_mask is not None for p in parts):
            out.loss_mask = sum(([p.token_loss_mask(i) for i in range(len(p))] for p in parts), [])
        if any(p.env_rewards is not None for p in parts):
            out.env_rewards = sum(
                (p.env_rewards if p.env_rewards is not None else [0.0] * len(p) for p in parts), []
            )
        if all(p.sampler_settings is not None for p in parts if len(p)) and len(out):
            out.sampler_settings = sum((p.sampler_settings or [] for p in parts), [])
        if all(p.token_versions is not None for p in parts if len(p)) and len(out):
            out.token_versions = sum((p.token_versions or [] for p in parts), [])
        return out


class RolloutEngine(Protocol):
    """Everything the driver calls on a rollout engine (grpo_ds.rollout.hf, agent, vllm)."""

    # generates with the policy's own module: update_weights is never called
    shares_policy_weights: bool
    # the module it generates with (None: it holds its weights itself, as vLLM)
    model: torch.nn.Module | None
    # vLLM's reload path: what completes a fused layer a LoRA sync touches, else None
    whole_layers: dict | None

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        rows: list[dict] | None = None,
    ) -> Rollouts:
        """``group_size`` completions of each prompt, consecutive; ``rows[i]`` is prompt i's data
        row (its columns), which multi-turn engines hand to the environment."""
        ...

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights in; return how many tensors were updated."""
        ...

    def continuous(self, capacity_rows: int) -> ContinuousEngine:
        """A running batch of at most ``capacity_rows`` rows on this engine's weights, for
        continuous generation (rollout.continuous; the recipe check refuses the engines that have
        none)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (vLLM: shut its engine down); idempotent. The session calls
        it last."""
        ...


class ContinuousEngine(Protocol):
    """A running batch that groups join and leave between decode steps
    (grpo_ds.rollout.hf_continuous.ContinuousDecoder; the schedule: grpo_ds.step.continuous)."""

    rows_in_flight: int
    free_rows: int

    def admit(self, request) -> None:
        """A GroupRequest's rows join at the next step."""
        ...

    def step(self) -> list:
        """One token for every row in flight; the FinishedGroups whose rows have all ended."""
        ...

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """New weights (optimizer step ``version``'s) between two decode steps."""
        ...

    def take_stats(self) -> tuple[int, int]:
        """(decode steps, rows decoded over them) since the last call."""
        ...


@dataclass(frozen=True)
class Turn:
    """One model turn of a multi-turn episode, as a turn sampler returns it."""

    ids: list[int]  # exactly as sampled
    logprobs: list[float]  # sampler log-probs of ids
    eos: bool  # ended by EOS (the last id)
    cut: bool  # ended by the token budget, not by EOS or a stop string


class TurnSampler(Protocol):
    """What generates the model turns of the agent engine: transformers generate
    (grpo_ds.rollout.agent.HFTurns) or vLLM (grpo_ds.rollout.vllm.VLLMRolloutEngine). It owns the
    weights the turns are sampled with."""

    shares_policy_weights: bool
    model: torch.nn.Module | None  # as RolloutEngine's
    whole_layers: dict | None  # as RolloutEngine's
    stop_ids: tuple[int, ...]  # the turn-ending EOS ids (grpo_ds.rollout.stop)

    def sample_turns(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        stops: list[tuple[str, ...]],
        sampling: SamplingParams,
        keys: list[int],
    ) -> list[Turn]:
        """One turn per context: sampled after ``contexts[i]`` (token ids, never re-encoded), ending
        at EOS, at the token that completes one of ``stops[i]`` in the turn's text, or after
        ``budgets[i]`` tokens. ``keys[i]`` identifies the (episode, turn) within the step, and seeds
        the turn's draws with ``sampling.seed``, so a turn does not depend on the batch it is
        sampled in; every turn of one call is sampled with ``sampling``."""
        ...

    def keep_going(self, active: bool) -> bool:
        """Whether another round of turns is sampled: this rank has ``active`` episodes, or (vLLM
        tensor parallel) another member of its engine's group does, which needs this rank in every
        round."""
        ...

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int: ...

    def close(self) -> None: ...
