"""The "builtin:tiny" model and tokenizer, built entirely in code so tests and CPU recipes never download anything.

The tokenizer is character level (one token per printable ASCII character, plus ChatML specials), so
decoding round-trips any text exactly. The model is a randomly initialised Llama-style causal LM whose
weights depend only on ``seed``. (Llama rather than Qwen2 on purpose: transformers 5 ignores a saved
``tokenizer_class`` for model_type "qwen2" and rebuilds a byte-level Qwen2Tokenizer, which would break a
saved builtin:tiny folder; for "llama" it honours the saved ``TokenizersBackend``.)
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

PAD, EOS, IM_START, IM_END, UNK = "<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, UNK)  # ids 0..4, in this order
CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c")  # letters, digits, punctuation, " \t\n\r"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer with ChatML specials; pads left (for generation), adds no BOS, never crashes on
    an unknown character (it becomes ``<unk>``)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece (``[\s\S]`` so newlines are pieces too); no normaliser, so spaces survive.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate pieces without inserting spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def tiny_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4) -> LlamaConfig:
    """The tiny model's architecture: a small Llama causal LM with sdpa attention (fine on CPU)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        attn_implementation="sdpa",
    )


def build_tiny_model(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A small random Llama causal LM; the same ``seed`` gives the same weights."""
    # Built on the CPU with a locally seeded CPU generator: identical weights on every machine and rank, and the
    # caller's RNG stream is left untouched. The caller moves the model to its device.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(vocab_size, hidden_size, num_layers, num_heads))
    return model.to(dtype)
