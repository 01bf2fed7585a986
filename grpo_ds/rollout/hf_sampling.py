"""What the hf engine's two decode loops share (grpo_ds.rollout.hf's generate calls and
grpo_ds.rollout.hf_continuous's running batch): the recipe's warpers as transformers builds them,
the refusal of a warper the model's own generation config would add, inverse-transform token
picking, left padding, and the module in eval mode for the duration."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import PreTrainedModel
from transformers.generation import (
    LogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_ds.rollout.base import SamplingParams

# Warpers that transformers would take from the model's own generation_config (a key our config
# leaves unset is filled from it) and apply after top-p, that is after TokenSampler: refused, see
# check_model_warpers.
_LATE_WARPERS = {
    "min_p": None,
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "watermarking_config": None,
    "renormalize_logits": False,
}  # key: its off value


def sample_tokens(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(B, V) log-probabilities and (B,) uniform numbers in [0, 1) -> (B, 1) one token per row drawn
    from them, by inverse transform sampling: the first token whose cumulative probability (float64)
    exceeds the row's number scaled to the row's total. A token of probability 0 (a warper's -inf)
    adds nothing to the cumulative sum, so it is never drawn."""
    cdf = logprobs.double().exp_().cumsum_(dim=-1)  # (B, V)
    draw = uniform.to(device=cdf.device, dtype=torch.float64).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).clamp_(max=cdf.shape[1] - 1)


def sampling_warpers(sampling: SamplingParams) -> list[LogitsProcessor]:
    """transformers' temperature, top-k and top-p warpers, built and ordered as generate builds them
    (GenerationMixin._get_logits_processor); none for greedy decoding."""
    if sampling.temperature <= 0:
        return []
    warpers: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return warpers


def check_model_warpers(model: PreTrainedModel) -> None:
    """Refuse a model generation_config that sets a warper grpo_ds does not apply (it samples in
    TokenSampler)."""
    own = getattr(model, "generation_config", None)
    for key, off in _LATE_WARPERS.items():
        value = getattr(own, key, off)
        if value is not None and value != off:
            raise ValueError(
                f"the model's generation_config sets {key}={value!r}; grpo_ds samples with the "
                "recipe's temperature, top_p and top_k only (and records the log-probs of that "
                f"distribution): remove {key} from generation_config.json or set it to {off!r}"
            )


def left_padded(contexts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, longest context) on the CPU: each context right-aligned
    after pads."""
    width = max(len(c) for c in contexts)
    input_ids = torch.tensor(
        [[pad_token_id] * (width - len(c)) + list(c) for c in contexts], dtype=torch.long
    )
    attention_mask = torch.tensor(
        [[0] * (width - len(c)) + [1] * len(c) for c in contexts], dtype=torch.long
    )
    return input_ids, attention_mask


@contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode for the duration (no dropout, no activation checkpointing, the KV
    cache on), then back in the mode it was in: the policy's own module, when the engine shares it,
    goes on training."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)
