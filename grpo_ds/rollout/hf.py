"""The ``hf`` rollout engine: transformers ``generate`` on an unsharded copy of the policy, or on
the policy itself.

The copy lives on the training device and is refreshed after every optimizer step from the
ZeRO-3 shards (see grpo_ds.model.weight_gather). Where every rank holds the policy's module whole
(ZeRO 0-2, no tensor or sequence parallelism: grpo_ds.config.deepspeed.rollout_shares_policy) the
engine generates with that module and there is no copy and no sync. Prompts are left-padded for
batched generation; position ids come from the attention mask, so they match the unpadded sequences
used in training.

Each token is picked, and its log-prob under the distribution it was sampled from (after
temperature, top-k and top-p; greedy: the logits) recorded, inside the generate loop by
TokenSampler, one step at a time, so the rollout's memory does not grow with the completion length
(asking generate for every step's scores held samples x length x vocabulary floats, twice: 40 GB
each at 64 x 1,024 x 151,936), and a sample costs one random number per row instead of one per
vocabulary entry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import Cache, GenerationConfig, PreTrainedModel
from transformers.generation import (
    CompileConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
)

from grpo_ds.rollout.base import Rollouts, SamplingParams
from grpo_ds.rollout.hf_compile import CompiledDecode
from grpo_ds.rollout.hf_continuous import ContinuousDecoder
from grpo_ds.rollout.hf_sampling import (
    check_model_warpers,
    eval_mode,
    left_padded,
    sample_tokens,
    sampling_warpers,
)
from grpo_ds.rollout.stop import stop_token_ids
from grpo_ds.rollout.streams import RowStreams


class TokenSampler(LogitsProcessor):
    """The last logits processor: it picks each row's next token itself and records that token's
    log-prob under the processed scores it was picked from, holding one step's log-probs at a time
    instead of every step's scores.

    ``generate`` runs in greedy mode (do_sample false) and calls it with the scores after every
    warper (see generate_left_padded); it returns scores that are 0 at the picked token and -inf
    elsewhere, so generate's argmax takes that token. Sampling draws the token by inverting the
    cumulative distribution: one uniform number per row and a float64 cumulative sum of the
    probabilities, where transformers' torch.multinomial draws an exponential number for every
    vocabulary entry (150 of the 230 ms of a step at 64 x 151,936 on 2 CPU cores). The distribution
    is the same, softmax(scores); the random numbers, and so the samples for a seed, are not. Row
    b's numbers come from its own stream (``streams``, grpo_ds.rollout.streams), so a sample does
    not depend on which other rows share its batch. Greedy decoding picks the argmax as generate
    would. The log-prob is gathered from torch.log_softmax of the same scores, the op the all-steps
    path (output_scores, then a log-softmax of each step) ran, so the numbers are bitwise the same
    for the same tokens. Nothing leaves the device inside the loop.
    """

    def __init__(self, streams: RowStreams | None) -> None:
        self.streams = streams  # None: greedy decoding
        # (B,) per step: log-prob of the token picked at that step
        self._taken: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logprobs = torch.log_softmax(scores, dim=-1)  # (B, V)
        tokens = (
            scores.argmax(dim=-1, keepdim=True)
            if self.streams is None
            else sample_tokens(logprobs, self.streams.uniform(len(self._taken)))
        )  # (B, 1)
        self._taken.append(logprobs.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, -torch.inf).scatter_(-1, tokens, 0.0)

    @property
    def steps(self) -> int:
        """Tokens picked so far per row (a compiled call's watchdog watches it grow)."""
        return len(self._taken)

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probs of ``new_tokens`` (B, T), the tokens generate returned. Rows that
        finished early hold pad tokens after EOS, with meaningless log-probs there, as before."""
        steps = new_tokens.shape[1]
        if len(self._taken) < steps:
            raise RuntimeError(
                f"generate returned {steps} new tokens but TokenSampler picked {len(self._taken)}"
            )
        return torch.stack(self._taken[:steps], dim=1)


def _generation_config(
    max_new_tokens: int,
    pad_token_id: int,
    stop_ids: Sequence[int],
    compile_config: CompileConfig | None = None,
) -> GenerationConfig:
    """transformers' settings for one generate call, greedy (TokenSampler picks the tokens, sampled
    or greedy); a row ends at any of ``stop_ids`` (grpo_ds.rollout.stop). The warpers are passed as
    processors, before TokenSampler (generate would put its own after a caller's processors). Each
    context comes ``num_return_sequences`` times in the batch already (greedy generate refuses more
    than one sequence per input). ``compile_config``: compile the decode step (with a static cache:
    grpo_ds.rollout.hf_compile)."""
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        num_return_sequences=1,
        pad_token_id=pad_token_id,
        eos_token_id=list(stop_ids),
        # the policy's config may turn the cache off for training
        use_cache=True,
        compile_config=compile_config,
    )


def generate_left_padded(
    model: PreTrainedModel,
    contexts: list[list[int]],
    sampling: SamplingParams,
    max_new_tokens: int,
    num_return_sequences: int,
    pad_token_id: int,
    stop_ids: Sequence[int],
    row_keys: Sequence[int],
    stopping_criteria: StoppingCriteriaList | None = None,
    compiled: CompiledDecode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched generate call on left-padded contexts, ``num_return_sequences`` consecutive rows
    per context, a row ending at any of ``stop_ids``:
    (new tokens (B, T_new), their log-probs under the distribution actually sampled from (B,
    T_new)), on the CPU. That distribution is the model's next-token logits after generate's own
    processors and the recipe's temperature, top-k and top-p (greedy: the logits themselves). Row b
    samples from the stream of (``sampling.seed``, ``row_keys[b]``). With ``compiled``
    (rollout.hf_compile, grpo_ds.rollout.hf_compile) the call decodes with a static cache and a
    compiled forward, and generates eagerly when that fails or hangs."""
    rows = len(contexts) * num_return_sequences
    if len(row_keys) != rows:
        raise ValueError(f"{len(row_keys)} row keys for {rows} rows")
    if sampling.temperature > 0:
        check_model_warpers(model)
    input_ids, attention_mask = left_padded(
        [c for c in contexts for _ in range(num_return_sequences)], pad_token_id
    )
    device = next(model.parameters()).device

    def attempt(
        picker: TokenSampler, compile_config: CompileConfig | None = None, **cache: Cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = _generation_config(max_new_tokens, pad_token_id, stop_ids, compile_config)
        sequences = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            logits_processor=LogitsProcessorList([*sampling_warpers(sampling), picker]),
            stopping_criteria=stopping_criteria,
            **cache,
        )
        new_tokens = sequences[:, input_ids.shape[1] :]  # (B, T_new)
        return new_tokens.cpu(), picker.finish(new_tokens).cpu()

    if compiled is not None:
        picker = _token_sampler(sampling, row_keys, device)
        done = compiled.run(
            lambda: attempt(
                picker, **compiled.generate_kwargs(model, rows, input_ids.shape[1], max_new_tokens)
            ),
            lambda: picker.steps,
        )
        if done is not None:
            return done
    return attempt(_token_sampler(sampling, row_keys, device))


def _token_sampler(
    sampling: SamplingParams, row_keys: Sequence[int], device: torch.device
) -> TokenSampler:
    """A fresh sampler for one generate attempt (it holds the steps picked so far): greedy at
    temperature 0, else row b drawing from the stream of (``sampling.seed``, ``row_keys[b]``)."""
    return TokenSampler(
        None if sampling.temperature <= 0 else RowStreams(sampling.seed, row_keys, device)
    )


class HFRolloutEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_id: int,
        batch_prompts: int,
        shares_policy_weights: bool = False,
        compiled: CompiledDecode | None = None,
    ) -> None:
        """``eos_token_id`` is the tokenizer's; a completion ends at it or at any other EOS id of
        the model's generation config, as vLLM's would (``stop_ids``, grpo_ds.rollout.stop).
        ``shares_policy_weights``: ``model`` is the policy's own module, so it never needs a weight
        sync. ``compiled``: decode with a static cache and a compiled forward, falling back to eager
        (rollout.hf_compile, grpo_ds.rollout.hf_compile)."""
        # The parameters keep requires_grad (generate runs under no_grad): with a frozen lm_head,
        # torch.matmul does not fold the prefill's last-position hidden states (a non-contiguous (B,
        # 1, H) slice) into one matrix product but runs B matrix-vector products over the whole
        # lm_head (9x slower at vocabulary 151,936).
        self.model = model
        self.shares_policy_weights = shares_policy_weights
        self.whole_layers = None  # transformers takes any tensor by name
        self.pad_token_id = pad_token_id
        self.stop_ids = stop_token_ids(eos_token_id, getattr(model, "generation_config", None))
        self.batch_prompts = batch_prompts  # prompts per generate() call
        self.compiled = compiled
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        rows: list[dict] | None = None,
    ) -> Rollouts:
        """``group_size`` completions of each prompt; ``rows`` (the prompts' data rows) is unused
        here. Sample k of ``prompts[i]`` is keyed (``sampling.first_prompt`` + i) * group_size + k:
        its draws do not depend on the batch (grpo_ds.rollout.streams)."""
        with eval_mode(self.model):
            parts = [
                self._generate_batch(
                    prompts[i : i + self.batch_prompts],
                    group_size,
                    sampling,
                    first_sample=(sampling.first_prompt + i) * group_size,
                )
                for i in range(0, len(prompts), self.batch_prompts)
            ]
        return Rollouts.concat(parts).drawn_with(sampling.settings)

    def _generate_batch(
        self, prompts: list[list[int]], group_size: int, sampling: SamplingParams, first_sample: int
    ) -> Rollouts:
        if not prompts:
            return Rollouts([], [], [], [])
        keys = range(first_sample, first_sample + len(prompts) * group_size)
        new_tokens, token_logprobs = generate_left_padded(
            self.model,
            prompts,
            sampling,
            sampling.max_new_tokens,
            group_size,
            self.pad_token_id,
            self.stop_ids,
            keys,
            compiled=self.compiled,
        )
        result = Rollouts([], [], [], [])
        for row, (ids, logprobs) in enumerate(
            zip(new_tokens.tolist(), token_logprobs.tolist(), strict=True)
        ):
            # pads come after
            stop = next((t + 1 for t, token in enumerate(ids) if token in self.stop_ids), None)
            length = stop if stop is not None else len(ids)
            result.prompt_ids.append(list(prompts[row // group_size]))
            result.response_ids.append(ids[:length])
            result.sampler_logprobs.append(logprobs[:length])
            result.finish_reason.append("stop" if stop is not None else "length")
        return result

    def continuous(self, capacity_rows: int) -> ContinuousDecoder:
        """A running batch of at most ``capacity_rows`` rows on this engine's module
        (rollout.continuous: grpo_ds.rollout.hf_continuous); it loads new weights itself."""
        return ContinuousDecoder(self.model, self.pad_token_id, self.stop_ids, capacity_rows)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        if self.shares_policy_weights:
            raise RuntimeError(
                "this engine generates with the policy's own module: there are no weights to sync"
            )
        count = 0
        for name, tensor in named_tensors:
            self._params[name].copy_(tensor)
            count += 1
        return count

    def close(self) -> None:
        """Nothing to release: the module is the policy's or a copy the garbage collector frees."""
