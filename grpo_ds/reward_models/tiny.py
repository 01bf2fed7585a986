"""Small reward models and their tokenizer, built in code (nothing is downloaded), for tests and CPU
recipes.

- ``build_reward_tokenizer``: a character-level tokenizer whose vocabulary is not builtin:tiny's
  (other specials, the characters in another order, other ids for every character) with a chat
  template of its own, so that a policy token id fed straight to a reward model reads as another
  character.
- ``build_tiny_reward_model``: a random Llama ``ForSequenceClassification`` (one label) from a
  config.
- ``write_digit_reward_model``: a reward model whose weights are set by hand so that its score rises
  with the share of one digit in the text it reads. Written as a Hugging Face folder with its
  tokenizer by

      python -m grpo_ds.reward_models.tiny FOLDER [--digit 7]

  or named in a recipe as ``builtin:digitD`` (``reward.models[].path``; D a digit), which
  grpo_ds.run.builtin_models writes on first use into grpo_ds's cache folder.

How the digit model computes (hidden size 4, one layer, one head). Every token's embedding is a unit
vector: e0 for the digit, e1 for any other token. The attention's query and key weights are zero, so
every position attends uniformly to its causal prefix (a sequence's own prefix when sequences are
packed); the value weights are the identity and the output projection moves (dim 0, dim 1) to (dim
2, dim 3). After the input RMSNorm (x 2 for a unit vector in 4 dimensions) the last token's hidden
state is e_last + (0, 0, 2r, 2(1 - r)), where r is the share of the digit among the n tokens read
(r = count / n). The MLP is zero. The final RMSNorm divides by sqrt((1 + 4r^2 + 4(1 - r)^2) / 4),
whatever the last token is, and the score head reads dim 2 times sqrt(5)/4:

    score(r) = sqrt(5) r / sqrt(5 - 8 r + 8 r^2),   score(0) = 0, score(1) = 1,

strictly increasing on [0, 1] (its derivative has the sign of 20 - 16 r). r counts every token read:
the chat template's markers and the prompt's tokens as well as the completion's; for a given prompt
and completion length the score is monotone in the completion's share of the digit. (up to float
rounding and RMSNorm's epsilon, 1e-6).
"""

from __future__ import annotations

import argparse
import math
import string
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from grpo_ds.distributed import launcher

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
# ids 0..6, in this order (builtin:tiny: pad is 0)
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, END, UNK, PAD)
# builtin:tiny's characters in reverse order, after seven specials: no character has builtin:tiny's
# id.
CHARS = tuple(reversed([c for c in string.printable if c not in "\x0b\x0c"]))
CHAT_TEMPLATE = (
    "{{ '<s>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_reward_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level, with its own specials and chat template; pads right, adds no special token
    itself (the chat template writes ``<s>``)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, END],
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def reward_config(
    tokenizer,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    initializer_range: float = 0.2,
    max_position_embeddings: int = 1024,
) -> LlamaConfig:
    """A small Llama sequence classifier with one label over ``tokenizer``'s vocabulary (sdpa
    attention)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=initializer_range,
        attn_implementation="sdpa",
    )


def build_tiny_reward_model(
    tokenizer,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    initializer_range: float = 0.2,
) -> LlamaForSequenceClassification:
    """A random reward model; the same ``seed`` gives the same weights, and the caller's RNG is left
    untouched. The initialiser's spread (0.2, not Llama's 0.02) makes scores of order 1 that differ
    between texts, so that a comparison to 1e-5 means something."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(
            reward_config(tokenizer, hidden_size, num_layers, num_heads, initializer_range)
        )
    return model.eval()


def build_digit_reward_model(tokenizer, digit: str = "7") -> LlamaForSequenceClassification:
    """The hand-set model of the module docstring: its score is sqrt(5) r / sqrt(5 - 8 r + 8 r^2)
    for the share r of ``digit`` among the tokens it reads."""
    if len(digit) != 1 or digit not in string.digits:
        raise ValueError(f"digit must be one of 0-9, got {digit!r}")
    config = reward_config(tokenizer, hidden_size=4, num_layers=1, num_heads=1)
    config.intermediate_size = 4
    model = LlamaForSequenceClassification(config)
    digit_id = tokenizer.convert_tokens_to_ids(digit)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        embed = model.model.embed_tokens.weight  # (V, 4)
        embed[:, 1] = 1.0  # e1: any token but the digit
        embed[digit_id] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # e0: the digit
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.v_proj.weight.copy_(torch.eye(4))
        out = layer.self_attn.o_proj.weight  # (4, 4): dims 0, 1 -> 2, 3
        out[2, 0], out[3, 1] = 1.0, 1.0
        model.model.norm.weight.fill_(1.0)
        model.score.weight[0, 2] = math.sqrt(5) / 4
    return model.eval()


def digit_score(share: float) -> float:
    """The digit model's score of a text in which ``share`` of the tokens are the digit (the module
    docstring)."""
    return math.sqrt(5) * share / math.sqrt(5 - 8 * share + 8 * share * share)


def write_reward_model(folder: str | Path, model, tokenizer) -> Path:
    """Save ``model`` and ``tokenizer`` as a Hugging Face folder (config.json, model.safetensors,
    tokenizer files)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_tiny_reward_model(folder: str | Path, seed: int = 0, **shape) -> Path:
    """A random reward model (``build_tiny_reward_model``) with the reward tokenizer, saved in
    ``folder``."""
    tokenizer = build_reward_tokenizer()
    return write_reward_model(folder, build_tiny_reward_model(tokenizer, seed, **shape), tokenizer)


def write_digit_reward_model(folder: str | Path, digit: str = "7") -> Path:
    """The hand-set digit reward model with the reward tokenizer, saved in ``folder``."""
    tokenizer = build_reward_tokenizer()
    return write_reward_model(folder, build_digit_reward_model(tokenizer, digit), tokenizer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_ds.reward_models.tiny",
        description="Write the hand-set digit reward model (its score rises with the "
        "share of one digit in the text) as a Hugging Face folder.",
    )
    parser.add_argument("folder", help="the folder to write (created if missing)")
    parser.add_argument(
        "--digit", default="7", choices=list(string.digits), help="the rewarded digit (default 7)"
    )
    args = parser.parse_args(argv)
    folder = write_digit_reward_model(args.folder, args.digit)
    launcher.say(f"wrote a reward model that rewards the digit {args.digit} to {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
