"""The "builtin:tiny" model and tokenizer, built entirely in code so tests and CPU recipes never
download anything.

The tokenizer is character level (one token per printable ASCII character, plus ChatML specials), so
decoding round-trips any text exactly. The model is a randomly initialised Llama-style causal LM
whose weights depend only on ``seed``. (Llama rather than Qwen2 on purpose: transformers 5 ignores a
saved ``tokenizer_class`` for model_type "qwen2" and rebuilds a byte-level Qwen2Tokenizer, which
would break a saved builtin:tiny folder; for "llama" it honours the saved ``TokenizersBackend``.)

With ``num_experts`` > 0 (the recipe's ``model.tiny_num_experts``) the model is a mixture of experts
in Qwen3-MoE's layout instead: every layer's MLP is a router (top-``experts_per_token`` of
``num_experts``, probabilities renormalised over the chosen ones) and ``num_experts`` SwiGLU experts
of intermediate size ``hidden_size``, held as one fused tensor per layer (transformers 5's
``Qwen3MoeExperts``: gate_up_proj (E, 2i, h), down_proj (E, h, i)). transformers honours the saved
tokenizer for "qwen3_moe" too (tests/model/test_tiny_moe.py saves and reloads one).
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from grpo_ds.config.recipe import ModelConfig

PAD, EOS, IM_START, IM_END, UNK = "<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, UNK)  # ids 0..4, in this order
# letters, digits, punctuation, " \t\n\r"
CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer with ChatML specials; pads left (for generation), adds no BOS,
    never crashes on an unknown character (it becomes ``<unk>``)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece (``[\s\S]`` so newlines are pieces too); no normaliser, so
    # spaces survive.
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


def tiny_shape(model_cfg: ModelConfig) -> dict:
    """The recipe's builtin:tiny keys (model.tiny_*) as keyword arguments of ``tiny_config`` and
    ``build_tiny_model``: the one place they are read."""
    return {
        "hidden_size": model_cfg.tiny_hidden_size,
        "num_layers": model_cfg.tiny_num_layers,
        "num_heads": model_cfg.tiny_num_heads,
        "num_experts": model_cfg.tiny_num_experts,
        "experts_per_token": model_cfg.tiny_experts_per_token,
    }


def tiny_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_experts: int = 0,
    experts_per_token: int = 2,
) -> PretrainedConfig:
    """The tiny model's architecture with sdpa attention (fine on CPU): a small Llama causal LM, or
    with ``num_experts`` > 0 a Qwen3-MoE whose every layer routes each token to
    ``experts_per_token`` experts."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
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
    if not num_experts:
        return LlamaConfig(intermediate_size=4 * hidden_size, **common)
    # intermediate_size is the size of a dense MLP, which no layer has (decoder_sparse_step 1, no
    # mlp_only_layers); router_aux_loss_coef 0: grpo_ds adds the load-balancing loss itself
    # (model.router_aux_loss_coef)
    return Qwen3MoeConfig(
        intermediate_size=4 * hidden_size,
        moe_intermediate_size=hidden_size,
        head_dim=hidden_size // num_heads,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        router_aux_loss_coef=0.0,
        **common,
    )


def build_tiny_model(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_experts: int = 0,
    experts_per_token: int = 2,
) -> PreTrainedModel:
    """A small random causal LM (``tiny_config``); the same ``seed`` gives the same weights."""
    # Built on the CPU with a locally seeded CPU generator: identical weights on every machine and
    # rank, and the caller's RNG stream is left untouched. The caller moves the model to its device.
    config = tiny_config(
        vocab_size, hidden_size, num_layers, num_heads, num_experts, experts_per_token
    )
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = tiny_model_class(config)(config)
    return model.to(dtype)


def tiny_model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The causal-LM class of a ``tiny_config``."""
    return Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else LlamaForCausalLM
