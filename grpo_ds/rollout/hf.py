"""The ``hf`` rollout engine: transformers ``generate`` on an unsharded copy of the policy.

The copy lives on the training device and is refreshed after every optimizer step from the
ZeRO-3 shards (see grpo_ds.rollout.weight_sync). Prompts are left-padded for batched generation;
position ids come from the attention mask, so they match the unpadded sequences used in training.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel

from grpo_ds.rollout.base import Rollouts, SamplingParams


def generation_config(sampling: SamplingParams, max_new_tokens: int, num_return_sequences: int, pad_token_id: int,
                      eos_token_id: int) -> GenerationConfig:
    """transformers' settings for one generate call: sampling, or greedy decoding when temperature is 0."""
    sampled = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
               "top_k": sampling.top_k} if sampling.temperature > 0 else {"do_sample": False}  # top_k 0 = off, not 50
    return GenerationConfig(**sampled, max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences,
                            pad_token_id=pad_token_id, eos_token_id=eos_token_id, output_scores=True,
                            return_dict_in_generate=True,
                            use_cache=True)  # the policy's config may turn the cache off for training


def generate_left_padded(model, contexts: list[list[int]], pad_token_id: int, config: GenerationConfig,
                         **generate_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched generate call on left-padded contexts: (new tokens (B, T_new), their log-probs under the
    distribution actually sampled from (B, T_new)), both on the CPU."""
    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, c in enumerate(contexts):
        input_ids[i, width - len(c):] = torch.tensor(c)
        attention_mask[i, width - len(c):] = 1
    device = next(model.parameters()).device
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         generation_config=config, **generate_kwargs)
    new_tokens = out.sequences[:, width:].cpu()  # (B, T_new)
    # scores are the processed logits actually sampled from: T_new tensors of (B, V)
    logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1).cpu()
    return new_tokens, logprobs.gather(-1, new_tokens[:, : logprobs.shape[1]].unsqueeze(-1)).squeeze(-1)


class HFRolloutEngine:
    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int, batch_prompts: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.batch_prompts = batch_prompts  # prompts per generate() call
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams,
                 rows: list[dict] | None = None) -> Rollouts:
        """``group_size`` completions of each prompt; ``rows`` (the prompts' data rows) is unused here."""
        torch.manual_seed(sampling.seed)
        parts = [self._generate_batch(prompts[i:i + self.batch_prompts], group_size, sampling)
                 for i in range(0, len(prompts), self.batch_prompts)]
        return Rollouts.concat(parts)

    def _generate_batch(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams) -> Rollouts:
        if not prompts:
            return Rollouts([], [], [], [])
        config = generation_config(sampling, sampling.max_new_tokens, group_size, self.pad_token_id, self.eos_token_id)
        new_tokens, token_logprobs = generate_left_padded(self.model, prompts, self.pad_token_id, config)
        result = Rollouts([], [], [], [])
        for row in range(new_tokens.shape[0]):
            ids = new_tokens[row].tolist()
            stop = ids.index(self.eos_token_id) + 1 if self.eos_token_id in ids else None
            length = stop if stop is not None else len(ids)
            result.prompt_ids.append(list(prompts[row // group_size]))
            result.response_ids.append(ids[:length])
            result.sampler_logprobs.append(token_logprobs[row, :length].tolist())
            result.finish_reason.append("stop" if stop is not None else "length")
        return result

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        count = 0
        for name, tensor in named_tensors:
            self._params[name].copy_(tensor)
            count += 1
        return count
