"""The builtin tiny tokenizer and model: exact round trips, fixed special ids, deterministic
weights."""

import string

import pytest
import torch

from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "1+2=3",
        "Hello, world!\n\tindented  two spaces ",
        " leading\n\nblank\r\n",
        "".join(c for c in string.printable if c not in "\x0b\x0c"),
    ],
)
def test_round_trip_is_exact(tok, text):
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no BOS added
    assert tok.decode(ids) == text


def test_special_ids_and_settings(tok):
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<eos>", 1)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert tok.bos_token is None
    assert tok.padding_side == "left"
    assert len(tok) == 5 + 98  # 5 specials + printable ASCII without \x0b \x0c


def test_special_tokens_in_text_are_single_tokens(tok):
    ids = tok("<|im_start|>a<|im_end|>")["input_ids"]
    assert ids == [2, tok.convert_tokens_to_ids("a"), 3]
    assert tok.decode(ids, skip_special_tokens=True) == "a"


def test_unknown_character_maps_to_unk(tok):
    ids = tok("aé€b")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["a", "<unk>", "<unk>", "b"]
    assert tok.unk_token_id not in (0, 1, 2, 3)


def test_chat_template_exact_string(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
        "1+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\n1+2=<|im_end|>\n"


def test_left_padding(tok):
    batch = tok(["1+2=", "12+33="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]


def test_model_forward_shape(tok):
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2)
    ids = torch.tensor([tok("1+2=")["input_ids"], tok("3+4=")["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 4, len(tok))
    assert logits.dtype == torch.float32
    assert model.config.pad_token_id == 0 and model.config.eos_token_id == 1
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_same_seed_same_weights_different_seed_differs():
    a, b, c = (build_tiny_model(50, seed=s) for s in (3, 3, 4))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_seeding_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(50, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_dtype_argument():
    model = build_tiny_model(50, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_generate_with_left_padding_matches_unpadded(tok):
    model = build_tiny_model(len(tok), seed=1)
    prompts = ["1+2=", "12+33="]
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, do_sample=False, max_new_tokens=3)
    assert out.shape == (2, batch["input_ids"].shape[1] + 3)
    # Padding must not change what the short prompt generates.
    alone = model.generate(
        **tok(prompts[:1], return_tensors="pt"), do_sample=False, max_new_tokens=3
    )
    assert torch.equal(out[0, -3:], alone[0, -3:])
