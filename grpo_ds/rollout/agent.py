"""The ``agent`` rollout engine: multi-turn episodes that interleave model turns with environment observations.

One episode per sample. The environment is reset from the sample's data row, then the model and the
environment take turns until the environment says done, the model samples EOS, the model has taken
``max_turns`` turns, or the response holds ``max_total_tokens`` tokens (model and observation tokens together)::

    response_ids = [reset text] [model turn 1] [observation 1] [model turn 2] ... [model turn k]
    loss_mask    =  0 ... 0      1 ... 1        0 ... 0         1 ... 1            1 ... 1

Token exactness: a model turn's tokens are kept exactly as sampled and the history is never decoded and
re-encoded; each observation is tokenized on its own (``tokenizer(text, add_special_tokens=False)``) and its
ids are appended. So the sequence the trainer scores (prompt_ids + response_ids) is token for token the one
the sampler conditioned on, and sampler_logprobs[i][t] is log p(response_ids[i][t]) under the processed
distribution (temperature, top-p, top-k) for model tokens and 0.0 for observation tokens.

A model turn ends at EOS, at one of the environment's ``turn_stop`` strings (the token that completes it is
the turn's last token), at ``sampling.max_new_tokens`` (a per-turn cap), or when the response budget runs out.
Every model turn is decoded on its own (special tokens skipped) and passed to ``env.step``; the rewards of all
steps add up to ``env_rewards[i]``. An observation is appended only if the model takes another turn; one that
does not fit in the budget is cut and the episode ends with "length". finish_reason is "stop" when the
environment said done or EOS was sampled, "length" when a turn or token limit ended the episode (a last turn
cut by a token limit is "length" even if the environment then said done).

Generation is batched over every still-active episode of a chunk of ``batch_prompts`` prompts: one left-padded
transformers ``generate`` call per turn, as the ``hf`` engine does. The weights live in a composed
HFRolloutEngine, so weight updates are the hf engine's.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import StoppingCriteria, StoppingCriteriaList

from grpo_ds.errors import UserError, first_line
from grpo_ds.rewards.loading import import_attribute
from grpo_ds.rollout.base import Rollouts, SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine, generate_left_padded, generation_config


@dataclass(frozen=True)
class StepResult:
    observation: str  # text shown to the model before its next turn ("" for none)
    reward: float  # this step's reward; a sample's env reward is the sum over its steps
    done: bool  # the episode is over (e.g. the model gave its final answer)


class Environment(Protocol):
    """One episode's environment. A fresh instance is made for every sample (so it may keep state).

    ``turn_stop``: strings that end a model turn as soon as the turn's text contains one (EOS always ends it).
    ``reset(row)``: start an episode for a data row (a dict of the dataset's columns); return text placed after
    the prompt before the model's first turn (usually ""). ``step(model_turn)``: react to the text of one model
    turn (decoded alone, special tokens skipped).
    """

    turn_stop: tuple[str, ...]

    def reset(self, row: dict) -> str: ...

    def step(self, model_turn: str) -> StepResult: ...


EnvFactory = Callable[[], Environment]  # a class, or functools.partial(cls, **options)


class AgentRolloutEngine:
    """Multi-turn rollouts; same surface as HFRolloutEngine, plus each prompt's data row in ``generate``."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int,
                 tokenizer: PreTrainedTokenizerBase, env_factory: EnvFactory, max_turns: int, max_total_tokens: int,
                 batch_prompts: int) -> None:
        if max_turns < 1 or max_total_tokens < 1:
            raise ValueError(f"max_turns ({max_turns}) and max_total_tokens ({max_total_tokens}) must be >= 1")
        self._hf = HFRolloutEngine(model, pad_token_id, eos_token_id, batch_prompts)  # owns the weights
        self.model = self._hf.model
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.batch_prompts = batch_prompts  # prompts per chunk; a chunk's episodes are generated together

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        return self._hf.update_weights(named_tensors)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams,
                 rows: list[dict] | None = None) -> Rollouts:
        """``group_size`` episodes per prompt (consecutive), each with its own environment; rows[i] is the data
        row of prompts[i] (required: environments are reset from it). Deterministic given ``sampling.seed``."""
        if rows is None or len(rows) != len(prompts):
            got = "no rows" if rows is None else f"{len(rows)} rows"
            raise ValueError(f"got {len(prompts)} prompts but {got}; give one data row per prompt")
        torch.manual_seed(sampling.seed)
        parts = [self._generate_chunk(prompts[i:i + self.batch_prompts], rows[i:i + self.batch_prompts],
                                      group_size, sampling)
                 for i in range(0, len(prompts), self.batch_prompts)]
        return Rollouts.concat(parts)

    def _generate_chunk(self, prompts: list[list[int]], rows: list[dict], group_size: int,
                        sampling: SamplingParams) -> Rollouts:
        episodes = []
        for prompt, row in zip(prompts, rows, strict=True):
            for _ in range(group_size):
                env = self.env_factory()
                episode = _Episode(env, list(prompt), tuple(getattr(env, "turn_stop", ())))
                self._observe(episode, _call(env.reset, dict(row), "reset"))
                episodes.append(episode)
        while active := [e for e in episodes if e.finish is None]:
            for episode, turn in zip(active, self._sample_turns(active, sampling), strict=True):
                episode.add(turn.ids, turn.logprobs, 1)
                episode.turns += 1
                text = self.tokenizer.decode(turn.ids[:-1] if turn.eos else turn.ids, skip_special_tokens=True)
                result = _call(episode.env.step, text, "step")
                episode.reward += float(result.reward)
                if result.done or turn.eos:
                    episode.finish = "length" if turn.cut else "stop"
                elif episode.turns >= self.max_turns or len(episode.ids) >= self.max_total_tokens:
                    episode.finish = "length"
                else:
                    self._observe(episode, result.observation)
        return Rollouts([e.prompt for e in episodes], [e.ids for e in episodes], [e.logprobs for e in episodes],
                        [e.finish for e in episodes], [e.mask for e in episodes], [e.reward for e in episodes])

    def _observe(self, episode: _Episode, text: str) -> None:
        """Append an observation's own tokens (loss mask 0, log-prob 0.0), cut to the budget; a budget left
        without room for a model token ends the episode."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        room = self.max_total_tokens - len(episode.ids)
        episode.add(ids[:room], [0.0] * min(len(ids), room), 0)
        if len(ids) >= room:
            episode.finish = "length"

    def _sample_turns(self, episodes: list[_Episode], sampling: SamplingParams) -> list[_Turn]:
        """One model turn for each episode, in one batched generate call."""
        contexts = [e.prompt + e.ids for e in episodes]
        budgets = [min(sampling.max_new_tokens, self.max_total_tokens - len(e.ids)) for e in episodes]
        # the stopping criterion counts new tokens from the padded width
        turn_end = _TurnEnd(max(len(c) for c in contexts), budgets, [e.stop for e in episodes], self.eos_token_id,
                            self.tokenizer)
        config = generation_config(sampling, max(budgets), 1, self.pad_token_id, self.eos_token_id)
        new_tokens, token_logprobs = generate_left_padded(self.model, contexts, self.pad_token_id, config,
                                                          stopping_criteria=StoppingCriteriaList([turn_end]))
        turns = []
        for b, length in enumerate(turn_end.lengths):
            if length is None:  # generate stopped without this criterion seeing the turn end: cannot happen
                raise RuntimeError(f"the turn of row {b} ended without EOS, a stop string or its budget")
            turns.append(_Turn(new_tokens[b, :length].tolist(), token_logprobs[b, :length].tolist(),
                               eos=turn_end.reasons[b] == "eos", cut=turn_end.reasons[b] == "budget"))
        return turns


@dataclass(frozen=True)
class _Turn:
    ids: list[int]  # exactly as sampled
    logprobs: list[float]  # sampler log-probs of ids
    eos: bool  # ended by EOS (the last id)
    cut: bool  # ended by the token budget, not by EOS or a stop string


@dataclass
class _Episode:
    env: Environment
    prompt: list[int]
    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)  # the response so far: model and observation tokens
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
    """Ends each row's turn at EOS, at a stop string in the turn's text, or at the row's token budget, and
    records the turn's length (how many new tokens belong to it)."""

    def __init__(self, start: int, budgets: list[int], stops: list[tuple[str, ...]], eos_token_id: int,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.start, self.budgets, self.stops, self.eos = start, budgets, stops, eos_token_id
        self.tokenizer = tokenizer
        self.lengths: list[int | None] = [None] * len(budgets)
        self.reasons: list[str | None] = [None] * len(budgets)  # "eos" | "stop_string" | "budget"

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        new = input_ids[:, self.start:].cpu()  # (B, t)
        t = new.shape[1]
        open_rows = [b for b, n in enumerate(self.lengths) if n is None]
        to_decode = [b for b in open_rows if self.stops[b] and int(new[b, -1]) != self.eos]
        texts = self.tokenizer.batch_decode(new[to_decode], skip_special_tokens=True) if to_decode else []
        stopped = {b for b, text in zip(to_decode, texts, strict=True) if any(s in text for s in self.stops[b])}
        for b in open_rows:
            reason = ("eos" if int(new[b, -1]) == self.eos else "stop_string" if b in stopped
                      else "budget" if t >= self.budgets[b] else None)
            if reason is not None:
                self.lengths[b], self.reasons[b] = t, reason
        return torch.tensor([n is not None for n in self.lengths], device=input_ids.device)


def _call(method: Callable[[Any], Any], arg: Any, name: str) -> Any:
    """Call env.reset / env.step, saying which environment method failed if it raises or returns a wrong type."""
    try:
        result = method(arg)
    except Exception as err:
        raise RuntimeError(f"environment {name}() raised {type(err).__name__}: {first_line(err)}") from err
    expected = StepResult if name == "step" else str
    if not isinstance(result, expected):
        raise TypeError(f"environment {name}() must return a {expected.__name__}, got {type(result).__name__}")
    return result


# ------------------------------------------------------------------------------------------ loading


def load_env_factory(name: str, options: dict | None = None, where: str = "rollout.env") -> EnvFactory:
    """Resolve a built-in environment name or "package.module:Class" and bind ``options`` (keyword arguments of
    the class, the recipe's ``<where>_options``); one environment is built to check them. Every mistake is a
    UserError, raised before any model is loaded."""
    from grpo_ds.envs import BUILTIN_ENVS  # the built-ins import this module

    options = {} if options is None else options
    options_where = f"{where}_options"
    if not isinstance(options, dict):
        raise UserError(options_where, f"expected an object, got {type(options).__name__}", 'e.g. {"call": "?"}')
    target = _resolve(where, name, BUILTIN_ENVS)
    try:
        inspect.signature(target).bind(**options)
    except TypeError as err:
        raise UserError(options_where, f"{name!r} does not take these options ({first_line(err)})",
                        "use the keyword arguments of its constructor") from None
    except ValueError:  # no signature to check (some C callables): building one below still checks
        pass
    try:
        env = target(**options)
    except Exception as err:
        raise UserError(options_where, f"building {name!r} raised {type(err).__name__}: {first_line(err)}",
                        "fix the option values") from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise UserError(where, f"{name!r} builds a {type(env).__name__}, which has no reset/step methods",
                        "an environment has reset(row) -> str and step(model_turn) -> StepResult")
    stop = getattr(env, "turn_stop", ())
    if not (isinstance(stop, tuple) and all(isinstance(s, str) and s for s in stop)):
        raise UserError(where, f"{name!r} has turn_stop {stop!r}", "make it a tuple of non-empty strings")
    return functools.partial(target, **options) if options else target


def _resolve(where: str, name: Any, builtins: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    if not isinstance(name, str) or not name.strip():
        raise UserError(where, f"expected an environment name, got {name!r}",
                        f"a built-in ({', '.join(builtins)}) or package.module:Class")
    name = name.strip()
    if ":" not in name:
        if name in builtins:
            return builtins[name]
        close = difflib.get_close_matches(name, list(builtins), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(where, f"unknown built-in environment {name!r}",
                        f"{hint}Built-ins are: {', '.join(builtins)}; or give your own as package.module:Class")
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UserError(where, f"{name!r} is not of the form package.module:Class", 'e.g. "my_envs:Maze"')
    target = import_attribute(where, module_name, attr, "class", brief=first_line)
    if not callable(target):
        raise UserError(where, f"{name!r} is a {type(target).__name__}, not a class or function",
                        "point at an environment class (or a function returning a new environment)")
    return target
