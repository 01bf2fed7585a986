"""Reward models scored under DeepSpeed (grpo_ds.reward_models.scorer) equal a plain transformers
forward of AutoModelForSequenceClassification on the same texts (fp32, 1e-5): at world sizes 1, 2
and 3, packed and padded, with and without offload; a reward model with its own vocabulary scores a
policy's completions from their text; a Qwen2 reward model saved with another tokenizer scores on
that tokenizer's ids; weights damaged after the pre-load checks are named in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.errors import UserError
from grpo_ds.model.tiny import build_tiny_tokenizer
from grpo_ds.reward_models.scorer import RewardModels
from grpo_ds.reward_models.tiny import (
    build_reward_tokenizer,
    build_tiny_reward_model,
    write_reward_model,
    write_tiny_reward_model,
)
from tests.launch import REPO, deepspeed_launch
from tests.scripts.reward_model_scores import (
    MICRO_TOKENS,
    SAMPLES,
    SHORT,
    VARIANTS,
    ds_config,
    score_variants,
    specs,
)

# fp32; measured worst case below 1e-6 (packed vs a sequence alone: the same sums, other order)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=0))


def reference(folder: str, spec: RewardModelSpec, samples=SAMPLES, tokenizer=None) -> list[float]:
    """The plain transformers score of each sample alone, rendered here from the rule (not by
    grpo_ds's render), with ``tokenizer`` (AutoTokenizer's from the folder unless given)."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    out = []
    for prompt, completion in samples:
        if spec.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                tokenize=False,
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt + completion)["input_ids"]
        ids = ids[-spec.max_length :] if spec.max_length else ids
        with torch.no_grad():
            logit = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        out.append((logit - spec.mean) / spec.std)
    return out


def expected_truncations(folder: str) -> int:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return sum(len(tokenizer(p + c)["input_ids"]) > SHORT for p, c in SAMPLES)


def check_variants(result: dict, folder: str, variants) -> None:
    expected = {spec.name: reference(folder, spec) for spec in specs(folder, False)}
    spread = torch.tensor(expected["chat"]).std().item()
    assert spread > 0.05, (
        "the random reward model scores every text alike: the comparison would prove nothing"
    )
    truncated = expected_truncations(folder)
    assert 0 < truncated < len(SAMPLES)
    for variant in variants:
        got = result[variant]
        for name, values in expected.items():
            worst = (torch.tensor(got["scores"][name]) - torch.tensor(values)).abs().max().item()
            assert worst <= TOLERANCE, f"{variant} {name}: {worst:.2e}"
        assert got["metrics"]["reward_truncated/short"] == truncated
        assert got["metrics"]["reward_truncated/chat"] == 0


def test_world_size_1_zero3_every_variant_equals_transformers(folder):
    dist = init_distributed()
    result = score_variants(folder, dist, zero3=True)
    check_variants(result, folder, [v for v, _, _ in VARIANTS])
    for variant, packing, offload in VARIANTS:
        assert result[variant]["stage"] == 3
        # offload: the engine keeps its partitions on the host
        assert result[variant]["param_offload"] is offload
        # the probe found that the model scores packed sequences as it scores each alone
        if packing:
            assert result[variant]["packing_problem"] == [None] * 3


def test_world_size_1_stage_1_offload_moves_the_module(folder):
    """One rank without zero3_on_one_rank: the run is stage 1 and the reward model a plain engine
    (stage 0), whose offload moves the module to the CPU after scoring (here already the device: the
    same code path)."""
    result = score_variants(folder, init_distributed(), zero3=False)
    check_variants(result, folder, [v for v, _, _ in VARIANTS])
    assert {result[v]["stage"] for v, _, _ in VARIANTS} == {0}
    assert all(result[v]["on_cpu"] for v, _, _ in VARIANTS)


@pytest.mark.parametrize("world_size", [2, 3])
def test_launched_world_sizes_every_variant_on_every_rank_equals_transformers(
    folder, tmp_path, world_size
):
    deepspeed_launch(
        world_size, [str(REPO / "tests/scripts/reward_model_scores.py"), str(tmp_path), folder]
    )
    for rank in range(world_size):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        check_variants(
            result,
            folder,
            [v for v, _, _ in VARIANTS] + (["packed_sp2"] if world_size == 2 else []),
        )
        assert {result[v]["stage"] for v, _, _ in VARIANTS} == {3}
        assert [result[v]["param_offload"] for v, _, _ in VARIANTS] == [o for _, _, o in VARIANTS]


def test_a_reward_model_with_its_own_vocabulary_scores_a_policys_completions(folder):
    """The policy (builtin:tiny's tokenizer) and the reward model (its own) share no token id for
    any character. The completions reach the scorer as the policy's decoded text and score as the
    reward model's own tokens do; the policy's ids read by the reward model give other scores, by
    far (so a scorer passing them would fail)."""
    policy = build_tiny_tokenizer()
    prompts = [p for p, _ in SAMPLES]
    # what a rollout holds
    completion_ids = [policy(c, add_special_tokens=False)["input_ids"] for _, c in SAMPLES]
    completions = [policy.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    spec = RewardModelSpec(path=folder, name="plain", chat_template=False)
    dist = init_distributed()
    models = RewardModels.build([spec], ds_config(1, False), dist, MICRO_TOKENS)
    got = torch.tensor(models.score_models(prompts, completions, dist).scores["plain"])
    expected = torch.tensor(reference(folder, spec))
    assert (got - expected).abs().max() <= TOLERANCE
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        passed_through = torch.tensor(
            [
                model(input_ids=torch.tensor([policy(p + c)["input_ids"]])).logits[0, 0].item()
                for p, c in SAMPLES
            ]
        )
    assert (passed_through - expected).abs().max() > 100 * TOLERANCE


def test_a_model_and_tokenizer_without_a_pad_token_score_in_padded_rows(tmp_path):
    """The rows of a padded micro-batch need some pad id (the model's own pooling, unused here,
    refuses more than one row without one): the scorer sets one, and the scores are still the plain
    forward's."""
    tokenizer = build_reward_tokenizer()
    tokenizer.pad_token = None
    model = build_tiny_reward_model(tokenizer, seed=1)
    model.config.pad_token_id = None
    folder = str(write_reward_model(tmp_path / "no_pad", model, tokenizer))
    assert AutoTokenizer.from_pretrained(folder).pad_token is None
    spec = RewardModelSpec(path=folder, name="no_pad", chat_template=False)
    dist = init_distributed()
    models = RewardModels.build([spec], ds_config(1, False), dist, MICRO_TOKENS, packing=False)
    scored = models.score_models([p for p, _ in SAMPLES], [c for _, c in SAMPLES], dist)
    got = torch.tensor(scored.scores["no_pad"])
    assert (got - torch.tensor(reference(folder, spec))).abs().max() <= TOLERANCE


def test_a_qwen2_reward_model_saved_with_another_tokenizer_scores_on_its_ids(tmp_path):
    """AutoTokenizer loads Qwen2Tokenizer from a qwen2 folder whatever tokenizer it saved, and that
    one drops the character tokenizer's spaces (tests/model/test_loading.py pins the cause). The
    scorer loads the saved class (grpo_ds.model.loading.load_saved_tokenizer): its scores are the
    plain forward's on the saved tokenizer's ids."""
    tokenizer = build_reward_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForSequenceClassification(config).eval()
    folder = str(write_reward_model(tmp_path / "qwen2", model, tokenizer))
    spec = RewardModelSpec(path=folder, name="qwen2", chat_template=False)
    dist = init_distributed()
    models = RewardModels.build([spec], ds_config(1, False), dist, MICRO_TOKENS)
    scored = models.score_models([p for p, _ in SAMPLES], [c for _, c in SAMPLES], dist)
    got = torch.tensor(scored.scores["qwen2"])
    expected = torch.tensor(reference(folder, spec, tokenizer=tokenizer))
    assert expected.std() > 0.05  # the model tells the texts apart
    assert (got - expected).abs().max() <= TOLERANCE


def test_overflow_error_stops_scoring_with_one_line(folder):
    dist = init_distributed()
    spec = RewardModelSpec(
        path=folder, name="strict", chat_template=False, max_length=SHORT, overflow="error"
    )
    models = RewardModels.build([spec], ds_config(1, False), dist, MICRO_TOKENS)
    with pytest.raises(UserError) as err:
        models.score_models([p for p, _ in SAMPLES], [c for _, c in SAMPLES], dist)
    assert "\n" not in str(err.value)
    assert "max_length 24" in str(err.value) and "truncate_left" in str(err.value)


@pytest.mark.parametrize("zero3", [False, True])
def test_weights_cut_short_after_the_checks_are_named_when_loading(tmp_path, folder, zero3):
    """The pre-load checks refuse a damaged file (tests/model/test_reward_model_checks.py); one
    damaged after them (a copy still running) is named by the load too, in one line, instead of
    safetensors' SafetensorError."""
    copy = Path(shutil.copytree(folder, tmp_path / "rm"))
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    spec = RewardModelSpec(path=str(copy), name="cut")
    with pytest.raises(UserError) as err:
        RewardModels.build([spec], ds_config(1, zero3), init_distributed(), MICRO_TOKENS)
    assert err.value.where == "reward model 'cut'" and "\n" not in str(err.value)
    assert err.value.what.startswith(f"{weights} is cut short: ")


def test_tensor_parallelism_is_refused_in_one_line_when_the_recipe_loads():
    from grpo_ds.config.loading import load_recipe

    model = [{"path": "some/folder"}]
    load_recipe({"reward": {"models": model}})  # no tensor parallelism: fine
    load_recipe({"train": {"tensor_parallel_size": 2}})  # no reward model: fine
    with pytest.raises(UserError) as err:
        load_recipe({"reward": {"models": model}, "train": {"tensor_parallel_size": 2}})
    assert str(err.value).startswith(
        "train.tensor_parallel_size: 2 with reward.models:"
    ) and "\n" not in str(err.value)
