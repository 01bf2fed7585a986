"""The tokens that end a completion: one set, computed here, for every rollout engine.

vLLM stops a request on the tokenizer's EOS and on every ``eos_token_id`` of the model folder's
generation config (``generation_config.json``, or when the folder has none, one derived from
``config.json``): vllm/config/model.py ``try_get_generation_config`` reads it,
vllm/sampling_params.py ``update_from_generation_config`` adds its ids to each request's
``stop_token_ids``, and vllm/v1/core/sched/utils.py ``check_stop`` ends the request on any of them,
keeping that token as the completion's last. Qwen2.5-Instruct, for instance, lists both
``<|im_end|>`` (its tokenizer's EOS) and ``<|endoftext|>``. transformers' ``generate`` reads the
same generation config when it loads a model (``model.generation_config``), but the hf and agent
engines pass their own ``eos_token_id``, which replaces it. So every engine takes
``stop_token_ids(...)``: the same completions end the same way whichever engine samples them
(finish_reason "stop", the stop token kept as the last response token).
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import AutoConfig, GenerationConfig


def stop_token_ids(
    eos_token_id: int | None, generation_config: GenerationConfig | None
) -> tuple[int, ...]:
    """The tokenizer's EOS first, then the generation config's ``eos_token_id`` (one id or a list),
    without repeats. Raises ValueError when there is none at all (generation could then only end at
    max_new_tokens)."""
    found = getattr(generation_config, "eos_token_id", None)
    ids = [eos_token_id, *(found if isinstance(found, Iterable) else [found])]
    stop = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    if not stop:
        raise ValueError("neither the tokenizer nor the model's generation config has an EOS token")
    return stop


def folder_generation_config(folder: str, trust_remote_code: bool) -> GenerationConfig | None:
    """The generation config vLLM reads from a model folder: generation_config.json, else one made
    from config.json, else None (the same fallbacks as vLLM's ``try_get_generation_config``)."""
    try:
        return GenerationConfig.from_pretrained(folder, local_files_only=True)
    except OSError:  # no generation_config.json
        try:
            return GenerationConfig.from_model_config(
                AutoConfig.from_pretrained(
                    folder, local_files_only=True, trust_remote_code=trust_remote_code
                )
            )
        except OSError:
            return None
