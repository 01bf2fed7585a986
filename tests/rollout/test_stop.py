"""One stop set for every rollout engine (grpo_ds.rollout.stop): the tokenizer's EOS plus every
eos_token_id of the model folder's generation config, where vLLM stops (the vLLM side against its
fake: tests/rollout/test_vllm.py)."""

import json

import pytest
from transformers import GenerationConfig

from grpo_ds.config.loading import load_recipe
from grpo_ds.model.loading import load_model, load_tokenizer
from grpo_ds.model.tiny import IM_END, build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout.agent import AgentRolloutEngine
from grpo_ds.rollout.base import SamplingParams
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.stop import folder_generation_config, stop_token_ids
from tests.rollout.test_agent import EchoEnv, recording
from tests.rollout.test_hf import favour_eos

TOK = build_tiny_tokenizer()
# a second EOS id, as Qwen-Instruct lists <|endoftext|> besides its own
SECOND = TOK.convert_tokens_to_ids(IM_END)


def model_folder(path, eos_ids):
    """A tiny model folder as users have them: weights, tokenizer, generation_config.json listing
    ``eos_ids``."""
    model = build_tiny_model(len(TOK), hidden_size=32, num_layers=1, num_heads=4, seed=0)
    model.generation_config.eos_token_id = eos_ids
    model.save_pretrained(path)
    TOK.save_pretrained(path)
    return path


def loaded(folder):
    """The rollout copy and tokenizer exactly as grpo_ds.train loads them from model.path."""
    cfg = load_recipe({"model": {"path": str(folder)}}).model
    tokenizer = load_tokenizer(cfg)
    return load_model(cfg, len(tokenizer), seed=0), tokenizer


def test_the_stop_set_is_the_tokenizer_eos_then_the_generation_configs():
    assert stop_token_ids(1, GenerationConfig(eos_token_id=[1, 7, 7])) == (1, 7)
    assert stop_token_ids(1, GenerationConfig(eos_token_id=7)) == (1, 7)
    assert stop_token_ids(1, GenerationConfig()) == stop_token_ids(1, None) == (1,)
    assert stop_token_ids(None, GenerationConfig(eos_token_id=[5])) == (5,)
    with pytest.raises(ValueError, match="no EOS|neither"):
        stop_token_ids(None, None)


def test_the_folder_generation_config_is_read_as_vllm_reads_it(tmp_path):
    folder = model_folder(tmp_path / "m", [TOK.eos_token_id, SECOND])
    assert folder_generation_config(str(folder), False).eos_token_id == [TOK.eos_token_id, SECOND]
    # then vLLM (and transformers) derive one from config.json
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [TOK.eos_token_id, 9]
    (folder / "config.json").write_text(json.dumps(config))
    assert folder_generation_config(str(folder), False).eos_token_id == [TOK.eos_token_id, 9]
    assert folder_generation_config(str(tmp_path / "missing"), False) is None


def test_the_hf_engine_stops_at_every_eos_of_the_generation_config(tmp_path):
    """A model that favours the second EOS id: with it listed in generation_config.json, every
    completion ends there ("stop", the id kept as its last token), as vLLM's would; listed nowhere,
    generation runs through it."""
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    prompts = [TOK.encode("1+2="), TOK.encode("30+4=")]
    both, tokenizer = loaded(model_folder(tmp_path / "both", [TOK.eos_token_id, SECOND]))
    engine = HFRolloutEngine(
        favour_eos(both, SECOND, bias=30.0, every=1),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        batch_prompts=8,
    )
    assert engine.stop_ids == (TOK.eos_token_id, SECOND)
    out = engine.generate(prompts, 3, sampling)
    assert out.finish_reason == ["stop"] * 6
    assert all(ids[-1] == SECOND and SECOND not in ids[:-1] for ids in out.response_ids)
    assert all(
        len(lp) == len(ids) for lp, ids in zip(out.sampler_logprobs, out.response_ids, strict=True)
    )

    only, tokenizer = loaded(model_folder(tmp_path / "only", TOK.eos_token_id))
    engine = HFRolloutEngine(
        favour_eos(only, SECOND, bias=30.0, every=1),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        batch_prompts=8,
    )
    assert engine.stop_ids == (TOK.eos_token_id,)
    out = engine.generate(prompts, 3, sampling)
    assert out.finish_reason == ["length"] * 6 and all(
        ids.count(SECOND) == 6 for ids in out.response_ids
    )


def test_the_agent_engine_ends_a_turn_at_every_eos_of_the_generation_config(tmp_path):
    model, tokenizer = loaded(model_folder(tmp_path / "both", [TOK.eos_token_id, SECOND]))
    factory, envs = recording(EchoEnv)
    engine = AgentRolloutEngine.on_hf(
        favour_eos(model, SECOND, bias=30.0, every=1),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        tokenizer,
        factory,
        max_turns=3,
        max_total_tokens=24,
        batch_prompts=8,
    )
    out = engine.generate(
        [TOK.encode("1+2=")], 2, SamplingParams(max_new_tokens=6, seed=0), rows=[{}]
    )
    # the model's first turn is its EOS: the episode ends there, "stop", after one turn
    assert out.finish_reason == ["stop", "stop"] and out.response_ids == [[SECOND], [SECOND]]
    assert [env.seen for env in envs] == [[""], [""]]
