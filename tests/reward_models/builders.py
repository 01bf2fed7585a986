"""Reward model folders for the tests, built from a config with random weights and the builtin
character tokenizer (grpo_ds.model.tiny): nothing is downloaded."""

from pathlib import Path

from transformers import LlamaConfig, LlamaForSequenceClassification

from grpo_ds.model.tiny import build_tiny_tokenizer

CONTEXT = 128  # max_position_embeddings of the models built here


def reward_model_config(**changes) -> LlamaConfig:
    """A tiny Llama with a one-label score head (vocabulary 128 > the tokenizer's 103 tokens, pad id
    0 = <pad>)."""
    values = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": CONTEXT,
        "num_labels": 1,
        "pad_token_id": 0,
    }
    return LlamaConfig(**{**values, **changes})


def write_reward_model(
    folder: Path, model_cls=LlamaForSequenceClassification, tokenizer: bool = True, **config
) -> Path:
    """A reward model folder: config.json and weights of ``model_cls`` (a one-label classifier
    unless told) over ``reward_model_config(**config)``, and the builtin tokenizer (pad <pad>,
    eos <eos>, a chat template)."""
    model_cls(reward_model_config(**config)).save_pretrained(folder)
    if tokenizer:
        build_tiny_tokenizer().save_pretrained(folder)
    return folder
