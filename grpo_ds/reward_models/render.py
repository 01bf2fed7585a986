"""A reward model's input: each prompt + completion rendered as text and tokenized by the reward
model's tokenizer.

The policy and a reward model may have different vocabularies (another tokenizer, another chat
template), so the scored input is built from strings only: with ``chat_template`` the conversation
``[{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]`` goes through
the reward model's ``apply_chat_template(tokenize=False)`` (the template writes its own special
tokens, so the text is tokenized without adding more), else the text is ``prompt + completion``
tokenized with the tokenizer's special tokens. Token ids of the policy never enter (trl#6952 and
OpenRLHF#242 fed them straight through).

A text longer than the model's ``max_length`` keeps its last ``max_length`` tokens
(``overflow: "truncate_left"``, counted: the end of the completion is what is judged) or stops the
run with one line (``"error"``).
"""

from __future__ import annotations

from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.errors import UserError


def render_texts(
    spec: RewardModelSpec, tokenizer, prompts: list[str], completions: list[str]
) -> list[str]:
    """The text the reward model reads for each sample (the chat template's rendering, or prompt +
    completion)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if not spec.chat_template:
        return [p + c for p, c in zip(prompts, completions, strict=True)]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
        )
        for p, c in zip(prompts, completions, strict=True)
    ]


def render(
    spec: RewardModelSpec,
    tokenizer,
    prompts: list[str],
    completions: list[str],
    max_length: int | None = None,
    first_sample: int = 0,
) -> tuple[list[list[int]], int]:
    """(token ids of each sample under the reward model's tokenizer, how many were truncated). The
    length cap is ``spec.max_length``, else ``max_length`` (the model's window, which the scorer
    passes), else none; ``first_sample``: the step's index of ``prompts[0]``, for the error's
    message."""
    texts = render_texts(spec, tokenizer, prompts, completions)
    if not texts:  # a rank with no share of a small batch
        return [], 0
    encoded = tokenizer(texts, add_special_tokens=not spec.chat_template)["input_ids"]
    limit = spec.max_length if spec.max_length is not None else max_length
    if limit is None:
        return [list(ids) for ids in encoded], 0
    out, truncated = [], 0
    for i, ids in enumerate(encoded):
        if len(ids) > limit:
            if spec.overflow == "error":
                raise UserError(
                    f"reward model {spec.name!r}",
                    f"sample {first_sample + i} is {len(ids)} tokens long "
                    f"once rendered, over its max_length {limit}",
                    'raise max_length (up to the model\'s window), or set overflow "truncate_left"',
                )
            ids, truncated = ids[-limit:], truncated + 1
        out.append(list(ids))
    return out, truncated
