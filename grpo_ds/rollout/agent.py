"""The ``agent`` rollout engine: multi-turn episodes that interleave model turns with environment
observations.

One episode per sample. The environment is reset from the sample's data row, then the model and the
environment take turns until the environment says done, the model samples EOS, the model has taken
``max_turns`` turns, or the response holds ``max_total_tokens`` tokens (model and observation tokens
together)::

    response_ids = [reset text] [model turn 1] [observation 1] [model turn 2] ... [model turn k]
    loss_mask    =  0 ... 0      1 ... 1        0 ... 0         1 ... 1            1 ... 1

Token exactness: a model turn's tokens are kept exactly as sampled and the history is never decoded
and re-encoded; each observation is tokenized on its own
(``tokenizer(text, add_special_tokens=False)``) and its ids are appended. So the sequence the
trainer scores (prompt_ids + response_ids) is token for token the one the sampler conditioned on,
and sampler_logprobs[i][t] is log p(response_ids[i][t]) under the processed distribution
(temperature, top-p, top-k) for model tokens and 0.0 for observation tokens.

A model turn ends at EOS, at one of the environment's ``turn_stop`` strings (the token that
completes it is the turn's last token), at ``sampling.max_new_tokens`` (a per-turn cap), or when the
response budget runs out. Every model turn is decoded on its own (special tokens skipped) and passed
to ``env.step``; the rewards of all steps add up to ``env_rewards[i]``. An observation is appended
only if the model takes another turn; one that does not fit in the budget is cut and the episode
ends with "length". finish_reason is "stop" when the environment said done or EOS was sampled,
"length" when a turn or token limit ended the episode (a last turn cut by a token limit is "length"
even if the environment then said done).

Generation is batched over every still-active episode of a chunk of ``batch_prompts`` prompts, one
round of turns at a time, by a turn sampler (grpo_ds.rollout.base.TurnSampler) that owns the
weights: ``HFTurns`` (one left-padded transformers ``generate`` call per round, as the ``hf`` engine
does; rollout.agent_backend "hf") or the vLLM engine (one request per episode and round, prompted
with the episode's token ids; "vllm"). Either way the tokens are kept as sampled, so the token
exactness above holds for both. The environment protocol (``Environment``, ``StepResult``) and the
loading of environments by name live in grpo_ds.envs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import StoppingCriteria, StoppingCriteriaList

from grpo_ds.envs.base import EnvFactory, Environment, StepResult
from grpo_ds.errors import first_line
from grpo_ds.rollout.base import Rollouts, SamplingParams, Turn, TurnSampler
from grpo_ds.rollout.hf import HFRolloutEngine, generate_left_padded
from grpo_ds.rollout.hf_sampling import eval_mode


class AgentRolloutEngine:
    """Multi-turn rollouts; same surface as HFRolloutEngine, plus each prompt's data row in
    ``generate``. ``turns`` samples the model turns and owns the weights (HFTurns, or a
    VLLMRolloutEngine)."""

    def __init__(
        self,
        turns: TurnSampler,
        tokenizer: PreTrainedTokenizerBase,
        env_factory: EnvFactory,
        max_turns: int,
        max_total_tokens: int,
        batch_prompts: int,
    ) -> None:
        if max_turns < 1 or max_total_tokens < 1:
            raise ValueError(
                f"max_turns ({max_turns}) and max_total_tokens ({max_total_tokens}) must be >= 1"
            )
        self.turns = turns
        self.shares_policy_weights = turns.shares_policy_weights
        self.model = turns.model  # the hf backend's module (None on vLLM, which holds its own)
        self.whole_layers = turns.whole_layers
        self.stop_ids = turns.stop_ids  # "EOS" below: any of them (grpo_ds.rollout.stop)
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        # prompts per chunk; a chunk's episodes are generated together
        self.batch_prompts = batch_prompts

    @classmethod
    def on_hf(
        cls,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_id: int,
        tokenizer: PreTrainedTokenizerBase,
        env_factory: EnvFactory,
        max_turns: int,
        max_total_tokens: int,
        batch_prompts: int,
        shares_policy_weights: bool = False,
    ) -> AgentRolloutEngine:
        """Turns from transformers generate on ``model`` (the policy's own module with
        ``shares_policy_weights``)."""
        turns = HFTurns(
            HFRolloutEngine(
                model, pad_token_id, eos_token_id, batch_prompts, shares_policy_weights
            ),
            tokenizer,
        )
        return cls(turns, tokenizer, env_factory, max_turns, max_total_tokens, batch_prompts)

    def continuous(self, capacity_rows: int):
        """None yet: the recipe check refuses rollout.continuous with this engine
        (grpo_ds.config.placement)."""
        raise NotImplementedError("continuous generation runs on the hf engine only so far")

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        return self.turns.update_weights(named_tensors)

    def close(self) -> None:
        self.turns.close()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        rows: list[dict] | None = None,
    ) -> Rollouts:
        """``group_size`` episodes per prompt (consecutive), each with its own environment; rows[i]
        is the data row of prompts[i] (required: environments are reset from it). Deterministic
        given ``sampling.seed`` and ``sampling.first_prompt``: an episode's turns are keyed by its
        place in the step (base.TurnSampler)."""
        if rows is None or len(rows) != len(prompts):
            got = "no rows" if rows is None else f"{len(rows)} rows"
            raise ValueError(f"got {len(prompts)} prompts but {got}; give one data row per prompt")
        with eval_mode(self.model) if self.model is not None else contextlib.nullcontext():
            parts = [
                self._generate_chunk(
                    prompts[i : i + self.batch_prompts],
                    rows[i : i + self.batch_prompts],
                    group_size,
                    sampling,
                    first_episode=(sampling.first_prompt + i) * group_size,
                )
                for i in range(0, len(prompts), self.batch_prompts)
            ]
        # vLLM: its memory back to the trainer until the next generation
        if hasattr(self.turns, "sleep"):
            self.turns.sleep()
        return Rollouts.concat(parts).drawn_with(sampling.settings)

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        rows: list[dict],
        group_size: int,
        sampling: SamplingParams,
        first_episode: int,
    ) -> Rollouts:
        episodes = []
        for prompt, row in zip(prompts, rows, strict=True):
            for _ in range(group_size):
                env = self.env_factory()
                episode = _Episode(
                    env,
                    list(prompt),
                    tuple(getattr(env, "turn_stop", ())),
                    first_episode + len(episodes),
                )
                self._observe(episode, _call(env.reset, dict(row), "reset"))
                episodes.append(episode)
        while self.turns.keep_going(bool(active := [e for e in episodes if e.finish is None])):
            for episode, turn in zip(active, self._sample_turns(active, sampling), strict=True):
                episode.add(turn.ids, turn.logprobs, 1)
                episode.turns += 1
                text = self.tokenizer.decode(
                    turn.ids[:-1] if turn.eos else turn.ids, skip_special_tokens=True
                )
                result = _call(episode.env.step, text, "step")
                episode.reward += float(result.reward)
                if result.done or turn.eos:
                    episode.finish = "length" if turn.cut else "stop"
                elif episode.turns >= self.max_turns or len(episode.ids) >= self.max_total_tokens:
                    episode.finish = "length"
                else:
                    self._observe(episode, result.observation)
        return Rollouts(
            [e.prompt for e in episodes],
            [e.ids for e in episodes],
            [e.logprobs for e in episodes],
            [e.finish for e in episodes],
            [e.mask for e in episodes],
            [e.reward for e in episodes],
        )

    def _observe(self, episode: _Episode, text: str) -> None:
        """Append an observation's own tokens (loss mask 0, log-prob 0.0), cut to the budget; a
        budget left without room for a model token ends the episode."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        room = self.max_total_tokens - len(episode.ids)
        episode.add(ids[:room], [0.0] * min(len(ids), room), 0)
        if len(ids) >= room:
            episode.finish = "length"

    def _sample_turns(self, episodes: list[_Episode], sampling: SamplingParams) -> list[Turn]:
        """One model turn for each episode, in one call of the turn sampler."""
        return self.turns.sample_turns(
            [e.prompt + e.ids for e in episodes],
            [min(sampling.max_new_tokens, self.max_total_tokens - len(e.ids)) for e in episodes],
            [e.stop for e in episodes],
            sampling,
            [e.index * self.max_turns + e.turns for e in episodes],
        )


class HFTurns:
    """Model turns from transformers generate: every round is one left-padded batched call on the hf
    engine's model, ended per row by ``_TurnEnd``. The hf engine owns the weights (its own copy, or
    the policy's module)."""

    def __init__(self, engine: HFRolloutEngine, tokenizer: PreTrainedTokenizerBase) -> None:
        self.engine = engine
        self.model = engine.model
        self.whole_layers = None
        self.shares_policy_weights = engine.shares_policy_weights
        self.stop_ids = engine.stop_ids
        self.pad_token_id = engine.pad_token_id
        self.tokenizer = tokenizer

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(named_tensors)

    def close(self) -> None:
        self.engine.close()

    def keep_going(self, active: bool) -> bool:
        return active

    def sample_turns(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        stops: list[tuple[str, ...]],
        sampling: SamplingParams,
        keys: list[int],
    ) -> list[Turn]:
        """Row i samples from the stream of (``sampling.seed``, ``keys[i]``)
        (grpo_ds.rollout.streams)."""
        # the stopping criterion counts new tokens from the padded width
        turn_end = _TurnEnd(
            max(len(c) for c in contexts), budgets, stops, self.stop_ids, self.tokenizer
        )
        new_tokens, token_logprobs = generate_left_padded(
            self.model,
            contexts,
            sampling,
            max(budgets),
            1,
            self.pad_token_id,
            self.stop_ids,
            keys,
            StoppingCriteriaList([turn_end]),
        )
        turns = []
        for b, length in enumerate(turn_end.lengths):
            # generate stopped without this criterion seeing the turn end: cannot happen
            if length is None:
                raise RuntimeError(
                    f"the turn of row {b} ended without EOS, a stop string or its budget"
                )
            turns.append(
                Turn(
                    new_tokens[b, :length].tolist(),
                    token_logprobs[b, :length].tolist(),
                    eos=turn_end.reasons[b] == "eos",
                    cut=turn_end.reasons[b] == "budget",
                )
            )
        return turns


@dataclass
class _Episode:
    env: Environment
    prompt: list[int]
    stop: tuple[str, ...]
    index: int  # the episode's place in the step (keys its turns' draws)
    # the response so far: model and observation tokens
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish: str | None = None  # set when the episode is over

    def add(self, ids: list[int], logprobs: list[float], mask: int) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [mask] * len(ids)


class _TurnEnd(StoppingCriteria):
    """Ends each row's turn at EOS (any of ``stop_ids``), at a stop string in the turn's text, or at
    the row's token budget, and records the turn's length (how many new tokens belong to it)."""

    def __init__(
        self,
        start: int,
        budgets: list[int],
        stops: list[tuple[str, ...]],
        stop_ids: tuple[int, ...],
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.start, self.budgets, self.stops, self.eos = start, budgets, stops, frozenset(stop_ids)
        self.tokenizer = tokenizer
        self.lengths: list[int | None] = [None] * len(budgets)
        self.reasons: list[str | None] = [None] * len(budgets)  # "eos" | "stop_string" | "budget"

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        new = input_ids[:, self.start :].cpu()  # (B, t)
        t = new.shape[1]
        open_rows = [b for b, n in enumerate(self.lengths) if n is None]
        to_decode = [b for b in open_rows if self.stops[b] and int(new[b, -1]) not in self.eos]
        texts = (
            self.tokenizer.batch_decode(new[to_decode], skip_special_tokens=True)
            if to_decode
            else []
        )
        stopped = {
            b
            for b, text in zip(to_decode, texts, strict=True)
            if any(s in text for s in self.stops[b])
        }
        for b in open_rows:
            reason = (
                "eos"
                if int(new[b, -1]) in self.eos
                else "stop_string"
                if b in stopped
                else "budget"
                if t >= self.budgets[b]
                else None
            )
            if reason is not None:
                self.lengths[b], self.reasons[b] = t, reason
        return torch.tensor([n is not None for n in self.lengths], device=input_ids.device)


def _call(method: Callable[[Any], Any], arg: Any, name: str) -> Any:
    """Call env.reset / env.step, saying which environment method failed if it raises or returns a
    wrong type."""
    try:
        result = method(arg)
    except Exception as err:
        raise RuntimeError(
            f"environment {name}() raised {type(err).__name__}: {first_line(err)}"
        ) from err
    expected = StepResult if name == "step" else str
    if not isinstance(result, expected):
        raise TypeError(
            f"environment {name}() must return a {expected.__name__}, got {type(result).__name__}"
        )
    return result
