"""The bucketed ZeRO-3 exporter: exact weights, one collective per bucket, one bucket alive, names,
tied weights."""

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.model.engine import create_train_engine
from grpo_ds.model.tiny import build_tiny_model
from grpo_ds.model.weight_gather import gathered_named_parameters
from tests.launch import deepspeed_launch


@pytest.fixture(scope="module")
def zero3_engine():
    init_distributed()
    model = build_tiny_model(64, hidden_size=32, num_layers=2, num_heads=4, seed=0)
    reference = copy.deepcopy(model)
    config = resolve_deepspeed_config(
        load_recipe(
            {
                "deepspeed": {
                    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}
                },
                "train": {"zero3_on_one_rank": True},
            }
        ),
        1,
        "cpu",
    )
    return create_train_engine(model, config), reference


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes", [2**20, 4096])
def test_gathered_weights_equal_the_model(zero3_engine, dtype, bucket_bytes):
    engine, reference = zero3_engine
    # really partitioned by ZeRO-3
    assert all(hasattr(p, "ds_id") for p in engine.module.parameters())
    # nothing is held outside a gather
    assert all(p.numel() == 0 for p in engine.module.parameters())
    expected = dict(reference.named_parameters())
    seen = []
    for name, tensor in gathered_named_parameters(engine.module, bucket_bytes, dtype=dtype):
        want = expected[name].detach().to(dtype or torch.float32)
        assert tensor.dtype == want.dtype
        torch.testing.assert_close(tensor, want, rtol=0, atol=0)
        seen.append(name)
    assert seen == list(expected)


def test_a_consumer_may_share_a_tensor_with_numpy(zero3_engine):
    engine, reference = zero3_engine  # buffers it cannot empty early are left to reference counting
    expected = {n: p.detach().numpy() for n, p in reference.named_parameters()}
    for name, tensor in gathered_named_parameters(engine.module, 4096):
        assert (tensor.numpy() == expected[name]).all()


def _tied_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_tied_weights_go_once_or_under_every_name():
    model = _tied_model()
    once = list(gathered_named_parameters(model, 2**20))
    # lm_head.weight is the embedding
    assert [n for n, _ in once] == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in dict(once)
    every = list(gathered_named_parameters(model, 2**20, tied="all"))
    assert [n for n, _ in every][:2] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert every[0][1] is every[1][1]  # one tensor (gathered once), two names
    assert len(every) == len(once) + 1
    with pytest.raises(ValueError, match="tied"):
        next(gathered_named_parameters(model, 2**20, tied="twice"))


def test_rename_maps_names_for_the_consumer_and_can_drop_them():
    model = _tied_model()
    renamed = dict(
        gathered_named_parameters(
            model,
            2**20,
            rename=lambda n: None if n.endswith("norm.weight") else n.replace("model.", "llm.", 1),
        )
    )
    params = dict(model.named_parameters())
    assert list(renamed) == [
        n.replace("model.", "llm.", 1) for n in params if not n.endswith("norm.weight")
    ]
    # no copy
    assert (
        renamed["llm.embed_tokens.weight"].data_ptr()
        == params["model.embed_tokens.weight"].data_ptr()
    )


def test_a_cast_copy_is_released_when_the_next_tensor_is_requested():
    model = _tied_model()
    stream = gathered_named_parameters(model, 2**20, dtype=torch.bfloat16)
    name, first = next(stream)
    torch.testing.assert_close(
        first, dict(model.named_parameters())[name].detach().bfloat16(), rtol=0, atol=0
    )
    assert first.untyped_storage().nbytes() > 0
    next(stream)
    # valid only until the next one: memory stays bounded
    assert first.untyped_storage().nbytes() == 0
    # the model itself is untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("weight_sync") / "runs.json"
    deepspeed_launch(2, ["tests/scripts/weight_sync_check.py", str(out)])
    return json.loads(out.read_text())


BUCKETED = ("one bucket", "quarter", "small", "bf16 tied all renamed")


@pytest.mark.slow
def test_one_collective_per_bucket_not_per_tensor(two_ranks):
    for runs in two_ranks:
        total, tensors = runs["padded_bytes"], runs["tensors"]
        # gathering tensor by tensor: a collective each
        assert runs["per-tensor collectives"] == tensors
        assert runs["one bucket"]["collectives"] == 1 and runs["one bucket"][
            "collective_bytes"
        ] == [total]
        for label in BUCKETED:
            run = runs[label]
            assert run["collectives"] == len(run["collective_bytes"]) <= tensors // 3, label
            # each parameter gathered once, the tied one too; one that rename drops under every
            # name, never
            dropped = runs["dropped_padded_bytes"] if label == "bf16 tied all renamed" else 0
            assert sum(run["collective_bytes"]) == total - dropped, label
    assert two_ranks[0] == two_ranks[1]  # every rank sees the same buckets


@pytest.mark.slow
def test_gathered_bytes_alive_never_exceed_one_bucket(two_ranks):
    for runs in two_ranks:
        for label in BUCKETED:
            run = runs[label]
            assert max(run["collective_bytes"]) <= run["bucket_bytes"], label
            # buffers of the collectives plus handed-out copies still alive, at every yield
            assert 0 < run["peak_alive_bytes"] <= run["bucket_bytes"], label
            assert run["alive_after"] == 0, label  # nothing left behind
        assert runs["small"]["bucket_bytes"] == 3 * runs["largest_padded_bytes"]  # the tight case


@pytest.mark.slow
def test_weights_names_and_dtype_on_two_ranks(two_ranks):
    for runs in two_ranks:
        names = runs["module_names"]
        assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight
        for label in ("one bucket", "quarter", "small"):
            assert runs[label]["names"] == names and runs[label]["max_abs_error"] == 0.0, label
        # bf16, the tied weight under both names, model.norm.weight dropped
        tied_all = runs["bf16 tied all renamed"]
        assert tied_all["names"] == [names[0], "lm_head.weight"] + [
            n for n in names[1:] if n != "model.norm.weight"
        ]
        assert tied_all["max_abs_error"] == 0.0  # exactly the bf16 cast of the weights
