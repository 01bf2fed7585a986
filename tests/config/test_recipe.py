"""Recipe schema: defaults, JSON loading, overrides, per-field checks, batch algebra, and what each
error says."""

import dataclasses
import json
from pathlib import Path

import pytest

from grpo_ds.config.loading import load_recipe
from grpo_ds.config.parse import parse_override
from grpo_ds.config.recipe import SECTIONS, Recipe, iter_fields
from grpo_ds.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def error_of(source, overrides=None) -> UserError:
    with pytest.raises(UserError) as info:
        load_recipe(source, overrides)
    return info.value


# ------------------------------------------------------------------------------------------ loading


def test_defaults_load_from_empty_dict():
    r = load_recipe({})
    assert r == Recipe()
    assert r.source_dir == "."
    assert (r.rollout.engine, r.rollout.prompts_per_step, r.rollout.group_size) == ("hf", 8, 8)
    assert r.train.lr == 1e-6 and r.train.samples_per_optimizer_step is None
    assert r.deepspeed == "ds_configs/zero3.json"
    assert r.reward.functions == [{"name": "exact_match", "weight": 1.0}]


def test_defaults_are_not_shared_between_recipes():
    a, b = load_recipe({}), load_recipe({})
    assert a.train.adam_betas == b.train.adam_betas and a.train.adam_betas is not b.train.adam_betas
    assert a.reward.functions is not b.reward.functions


def test_json_file_sets_values_and_source_dir(tmp_path):
    folder = tmp_path / "sub"
    folder.mkdir()
    path = folder / "r.json"
    path.write_text(json.dumps({"train": {"lr": 0.01, "steps": 3}, "rollout": {"group_size": 4}}))
    r = load_recipe(path)
    assert (r.train.lr, r.train.steps, r.rollout.group_size) == (0.01, 3, 4)
    assert r.source_dir == str(folder)
    assert r.rollout.prompts_per_step == 8  # untouched keys keep their defaults
    assert load_recipe(str(path)) == r


def test_repo_tiny_cpu_recipe_loads():
    r = load_recipe(REPO / "recipes" / "tiny_cpu.json")
    assert r.samples_per_step == 25 * 32
    assert r.source_dir == str(REPO / "recipes")


def test_missing_recipe_file(tmp_path):
    err = error_of(tmp_path / "nope.json")
    assert err.where == str(tmp_path / "nope.json")
    assert "not found" in err.what and err.fix


def test_invalid_json_file_names_line(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{\n  "train": {"lr": 0.1,}\n}\n')
    err = error_of(path)
    assert err.where.startswith(f"{path}:2:")
    assert err.what.startswith("invalid JSON")


def test_recipe_must_be_an_object(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("[1, 2]")
    err = error_of(path)
    assert err.where == str(path) and "JSON object" in err.what


def test_section_must_be_an_object():
    err = error_of({"train": [1]})
    assert err.where == "train" and "got a list" in err.what


# ---------------------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("train.lr=1e-5", "train.lr", 1e-5),
        ("rollout.engine=hf", "rollout.engine", "hf"),
        ("train.samples_per_optimizer_step=null", "train.samples_per_optimizer_step", None),
        ("train.adam_betas=[0.9, 0.95]", "train.adam_betas", [0.9, 0.95]),
        (
            'deepspeed={"zero_optimization": {"stage": 2}}',
            "deepspeed",
            {"zero_optimization": {"stage": 2}},
        ),
        ("data.shuffle=false", "data.shuffle", False),
        ("run.name=123", "run.name", 123),  # JSON when it parses ...
        ('run.name="123"', "run.name", "123"),  # ... so quote a string that looks like a number
        ("run.name=a=b", "run.name", "a=b"),  # only the first '=' separates
        (" train.steps =5", "train.steps", 5),
    ],
)
def test_parse_override(text, key, value):
    k, v = parse_override(text)
    assert k == key
    assert v == value and type(v) is type(value)


def test_parse_override_without_equals():
    with pytest.raises(UserError) as info:
        parse_override("train.lr")
    assert info.value.where == "override 'train.lr'"
    assert "section.key=value" in info.value.what and "train.lr=1e-5" in info.value.fix


def test_overrides_apply_over_the_file():
    r = load_recipe(
        {"train": {"samples_per_optimizer_step": 32, "lr": 0.5}},
        [
            "train.lr=1e-5",
            "rollout.engine=hf",
            "train.samples_per_optimizer_step=null",
            'reward.functions=[{"name": "format", "weight": 0.5}]',
            "train.adam_betas=[0.8, 0.9]",
            "run.name=my run",
        ],
    )
    assert r.train.lr == 1e-5 and isinstance(r.train.lr, float)
    assert r.rollout.engine == "hf"
    assert r.train.samples_per_optimizer_step is None
    assert r.reward.functions == [{"name": "format", "weight": 0.5}]
    assert r.train.adam_betas == [0.8, 0.9]
    assert r.run.name == "my run"


def test_later_override_wins():
    assert load_recipe({}, ["train.steps=3", "train.steps=7"]).train.steps == 7


def test_int_for_float_field_is_widened():
    r = load_recipe({}, ["train.lr=1"])
    assert r.train.lr == 1.0 and isinstance(r.train.lr, float)


def test_dict_overrides_take_python_values_as_they_are():
    r = load_recipe({}, {"train.lr": 1e-5, "rollout.group_size": 4, "run.name": "123"})
    assert (r.train.lr, r.rollout.group_size, r.run.name) == (1e-5, 4, "123")
    err = error_of({}, {"train.lr": "1e-5"})  # a dict value is not parsed as JSON
    assert err.where == "train.lr" and "got a string" in err.what


def test_override_edits_inline_deepspeed_object():
    r = load_recipe(
        {"deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True}}},
        ["deepspeed.zero_optimization.stage=2", "deepspeed.bf16.enabled=true"],
    )
    assert r.deepspeed == {
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "bf16": {"enabled": True},
    }


def test_override_replaces_deepspeed_then_edits_it():
    r = load_recipe(
        {}, ['deepspeed={"zero_optimization": {"stage": 3}}', "deepspeed.zero_optimization.stage=1"]
    )
    assert r.deepspeed == {"zero_optimization": {"stage": 1}}
    assert (
        load_recipe({}, ["deepspeed=ds_configs/zero3_offload.json"]).deepspeed
        == "ds_configs/zero3_offload.json"
    )


def test_override_of_deepspeed_key_when_deepspeed_is_a_path():
    err = error_of({"deepspeed": "ds_configs/zero3.json"}, ["deepspeed.zero_optimization.stage=2"])
    assert err.where == "override deepspeed.zero_optimization.stage"
    assert "file path" in err.what and "inline" in err.fix
    err = error_of({}, ["deepspeed.zero_optimization.stage=2"])  # the default is a path too
    assert "file path" in err.what


def test_deepspeed_must_be_path_or_object():
    err = error_of({"deepspeed": 3})
    assert err.where == "deepspeed" and "got an integer" in err.what and "zero3.json" in err.fix


def test_deepspeed_override_through_a_number_is_a_user_error():
    error_of({"deepspeed": {"train_batch_size": 8}}, ["deepspeed.train_batch_size.x=1"])


def test_override_with_too_many_dots():
    err = error_of({}, ["train.lr.x=1"])
    assert err.where == "override train.lr.x" and "section.key" in err.what


# ------------------------------------------------------------------------------------ unknown names


def test_unknown_section_in_file_suggests():
    err = error_of({"trian": {"lr": 1}})
    assert "trian" in err.where and err.what == "unknown section"
    assert err.fix == "did you mean 'train'?"


def test_unknown_section_in_override_suggests():
    err = error_of({}, ["rollot.group_size=4"])
    assert err.where == "override rollot.group_size"
    assert "unknown section 'rollot'" in err.what and err.fix == "did you mean 'rollout'?"


def test_unknown_key_suggests():
    err = error_of({}, ["train.lrr=1"])
    assert (err.where, err.what, err.fix) == ("train.lrr", "unknown key", "did you mean 'lr'?")
    assert str(err) == "train.lrr: unknown key. did you mean 'lr'?"  # no '.' after a '?'
    err = error_of({"rollout": {"group_szie": 4}})
    assert err.where == "rollout.group_szie" and err.fix == "did you mean 'group_size'?"


def test_unknown_key_far_from_any_lists_valid_keys():
    err = error_of({}, ["train.zzzzzz=1"])
    assert err.where == "train.zzzzzz" and err.fix.startswith("valid keys:")
    for name in ("steps", "lr", "samples_per_optimizer_step"):
        assert name in err.fix


# ------------------------------------------------------------------------------------- field checks


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("train.lr", "fast", 'expected a number, got a string "fast"'),
        ("train.steps", True, "expected an integer, got a boolean true"),
        ("train.steps", 1.5, "expected an integer, got a number 1.5"),
        ("data.shuffle", 1, "expected a boolean, got an integer 1"),
        ("data.shuffle", "yes", 'expected a boolean, got a string "yes"'),
        ("run.name", 5, "expected a string, got an integer 5"),
        ("rollout.temperature", [1.0], "expected a number, got a list [1.0]"),
    ],
)
def test_wrong_type(key, value, what):
    err = error_of({}, {key: value})
    assert (err.where, err.what) == (key, what)
    assert err.fix.startswith("e.g. ")


def test_wrong_type_from_command_line_string():
    err = error_of({}, ["train.steps=ten"])
    assert err.where == "train.steps" and 'got a string "ten"' in err.what and err.fix == "e.g. 100"


def test_null_for_non_nullable():
    err = error_of({}, ["rollout.engine=null"])
    assert (err.where, err.what) == ("rollout.engine", "must not be null") and '"hf"' in err.fix


@pytest.mark.parametrize("value", [None, 5])
def test_list_field_errors_say_how_to_fix(value):
    err = error_of({}, {"train.adam_betas": value})
    assert err.where == "train.adam_betas"
    assert "0.9" in err.fix and "MISSING" not in err.fix


@pytest.mark.parametrize(
    "key, value, rule, default",
    [
        ("train.lr", -1e-5, "must be > 0.0", "1e-06"),
        ("train.lr", 0, "must be > 0.0", "1e-06"),
        ("rollout.group_size", 1, "must be >= 2", "8"),
        ("rollout.top_p", 1.5, "must be <= 1.0", "1.0"),
        ("rollout.top_p", 0, "must be > 0.0 and <= 1.0", "1.0"),
        ("algorithm.clip_low", 0, "must be > 0.0 and <= 1.0", "0.2"),
        ("algorithm.clip_low", 1.5, "must be <= 1.0", "0.2"),
        ("rollout.temperature", 0, "must be > 0.0", "1.0"),
        ("run.seed", -1, "must be >= 0", "0"),
        ("algorithm.kl_coef", -0.1, "must be >= 0.0", "0.0"),
    ],
)
def test_out_of_range(key, value, rule, default):
    err = error_of({}, {key: value})
    assert err.where == key
    assert "out of range" in err.what and rule in err.what
    assert err.fix == f"e.g. {default}"


def test_out_of_range_without_default_still_says_what_to_do():
    err = error_of({}, ["train.samples_per_optimizer_step=0"])
    assert (
        err.where == "train.samples_per_optimizer_step" and "must be >= 1" in err.what and err.fix
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("rollout.top_p", 1.0),
        ("algorithm.clip_low", 1.0),
        ("rollout.group_size", 2),
        ("algorithm.kl_coef", 0.0),
        ("run.seed", 0),
        ("rollout.top_k", 0),
        ("train.max_grad_norm", 0.0),
        ("algorithm.clip_high", 5.0),
    ],
)
def test_bounds_are_accepted(key, value):
    section, name = key.split(".")
    assert getattr(getattr(load_recipe({}, {key: value}), section), name) == value


@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("algorithm.loss_agg", "token_mean", "did you mean 'token-mean'?"),
        ("model.dtype", "fp16", "did you mean 'float16'?"),
        ("data.on_bad_row", "skp", "did you mean 'skip'?"),
    ],
)
def test_choices_suggest(key, value, fix):
    err = error_of({}, {key: value})
    assert err.where == key and err.what.startswith(f"{value!r} is not one of ")
    assert err.fix == fix


def test_choices_list_every_allowed_value():
    err = error_of({}, ["algorithm.loss_agg=mean"])
    for choice in (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ):
        assert repr(choice) in err.what


# ------------------------------------------------------------------------------------ batch algebra


def test_samples_per_optimizer_step_must_divide():
    err = error_of(
        {"rollout": {"prompts_per_step": 8, "group_size": 8}},
        ["train.samples_per_optimizer_step=24"],
    )
    assert err.where == "train.samples_per_optimizer_step"
    assert "24 does not divide the samples per step 64" in err.what
    assert "prompts_per_step 8 x group_size 8" in err.what
    suggested = [int(x) for x in err.fix.split("such as ")[1].split(", or")[0].split(", ")]
    assert suggested == [8, 16, 32]  # the three divisors of 64 nearest to 24
    assert "null for all 64" in err.fix


def test_samples_per_optimizer_step_more_than_samples_per_step():
    err = error_of(
        {"rollout": {"prompts_per_step": 8, "group_size": 8}},
        ["train.samples_per_optimizer_step=128"],
    )
    assert err.where == "train.samples_per_optimizer_step" and "128" in err.what
    assert "64" in err.fix


@pytest.mark.parametrize(
    "spos, epochs, steps", [(None, 1, 1), (64, 1, 1), (16, 1, 4), (16, 3, 12), (1, 2, 128)]
)
def test_optimizer_steps_per_rollout(spos, epochs, steps):
    r = load_recipe(
        {
            "rollout": {"prompts_per_step": 8, "group_size": 8},
            "train": {"samples_per_optimizer_step": spos, "epochs_per_rollout": epochs},
        }
    )
    assert r.samples_per_step == 64
    assert r.samples_per_optimizer_step == (spos or 64)
    assert r.optimizer_steps_per_rollout == steps


def test_samples_per_step_is_p_times_g():
    r = load_recipe({"rollout": {"prompts_per_step": 5, "group_size": 3}})
    assert r.samples_per_step == 15 and r.samples_per_optimizer_step == 15


def test_loss_agg_norm_tokens_defaults_to_max_new_tokens():
    assert load_recipe({"rollout": {"max_new_tokens": 77}}).loss_agg_norm_tokens == 77
    assert (
        load_recipe(
            {"rollout": {"max_new_tokens": 77}}, ["algorithm.loss_agg_norm_tokens=500"]
        ).loss_agg_norm_tokens
        == 500
    )


@pytest.mark.parametrize("betas", [[0.9], [0.9, 0.99, 0.999], [0.9, 1.0], [-0.1, 0.9], [0.9, "x"]])
def test_adam_betas_invalid(betas):
    err = error_of({}, {"train.adam_betas": betas})
    assert err.where == "train.adam_betas" and "two numbers in [0, 1)" in err.what
    assert err.fix == "e.g. [0.9, 0.999]"


def test_adam_betas_valid():
    assert load_recipe({}, ["train.adam_betas=[0, 0.5]"]).train.adam_betas == [0, 0.5]


def test_adam_betas_rejects_booleans():
    error_of({}, ["train.adam_betas=[false, 0.5]"])


def test_reward_functions_empty():
    err = error_of({}, ["reward.functions=[]"])
    assert (err.where, err.what) == ("reward.functions", "is empty") and "exact_match" in err.fix


@pytest.mark.parametrize(
    "functions, where, fragment",
    [
        (["exact_match"], "reward.functions[0]", "must be an object with a string name"),
        ([{"weight": 1.0}], "reward.functions[0]", "must be an object with a string name"),
        ([{"name": 3}], "reward.functions[0]", "must be an object with a string name"),
        (
            [{"name": "exact_match"}, {"name": "format", "wieght": 1}],
            "reward.functions[1].wieght",
            "unknown key",
        ),
        (
            [{"name": "exact_match", "weight": "1"}],
            "reward.functions[0].weight",
            "expected a number, got a string",
        ),
        (
            [{"name": "exact_match", "weight": True}],
            "reward.functions[0].weight",
            "expected a number, got a boolean",
        ),
    ],
)
def test_reward_functions_bad_entries(functions, where, fragment):
    err = error_of({}, {"reward.functions": functions})
    assert err.where == where and fragment in err.what and err.fix


def test_reward_function_unknown_key_suggests():
    err = error_of({}, {"reward.functions": [{"name": "format", "wieght": 1}]})
    assert err.fix == "did you mean 'weight'?"


def test_max_tokens_per_micro_batch_below_longest_sequence():
    base = {"data": {"max_prompt_tokens": 64}, "rollout": {"max_new_tokens": 64}}
    err = error_of(base, ["train.max_tokens_per_micro_batch=100"])
    assert err.where == "train.max_tokens_per_micro_batch"
    assert "100 is less than the longest possible sequence 128" in err.what
    assert "at least 128" in err.fix
    assert (
        load_recipe(base, ["train.max_tokens_per_micro_batch=128"]).train.max_tokens_per_micro_batch
        == 128
    )


def test_tiny_num_heads_must_divide_hidden():
    err = error_of({"model": {"tiny_hidden_size": 64, "tiny_num_heads": 5}})
    assert (
        err.where == "model.tiny_num_heads"
        and "5 does not divide tiny_hidden_size 64" in err.what
        and err.fix
    )
    assert (
        load_recipe({"model": {"tiny_hidden_size": 64, "tiny_num_heads": 8}}).model.tiny_num_heads
        == 8
    )
    # the rule only concerns the builtin model
    assert (
        load_recipe(
            {"model": {"path": "/some/hf/folder", "tiny_num_heads": 5}}
        ).model.tiny_num_heads
        == 5
    )


def test_user_error_str_is_where_what_fix():
    err = error_of({}, ["rollout.group_size=1"])
    assert str(err) == "rollout.group_size: 1 is out of range: must be >= 2. e.g. 8."


# ------------------------------------------------------------------------------------------ schema


def test_recipe_is_frozen():
    r = load_recipe({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.train.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.train = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.deepspeed = {}


def test_every_field_has_a_doc():
    seen = set()
    for section, f in iter_fields():
        doc = f.metadata.get("doc")
        assert isinstance(doc, str) and doc.strip(), f"{section}.{f.name} has no doc"
        seen.add((section, f.name))
    expected = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)} | {
        (None, "deepspeed")
    }
    assert seen == expected
    assert (None, "source_dir") not in seen


def test_every_default_satisfies_its_own_declaration():
    for section, f in iter_fields():
        if section is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        meta = f.metadata
        if meta["choices"] and default is not None:  # null: an optional key
            assert default in meta["choices"], f"{section}.{f.name}"
        if default is not None and meta["low"] is not None:
            assert default > meta["low"] if meta["low_open"] else default >= meta["low"], (
                f"{section}.{f.name}"
            )
        if default is not None and meta["high"] is not None:
            assert default <= meta["high"], f"{section}.{f.name}"


def test_to_dict_round_trips():
    r = load_recipe(
        REPO / "recipes" / "tiny_cpu.json",
        [
            "train.samples_per_optimizer_step=100",
            "algorithm.loss_agg=seq-mean-token-sum-norm",
            'deepspeed={"zero_optimization": {"stage": 2}}',
            "rollout.top_p=0.9",
        ],
    )
    d = r.to_dict()
    assert "source_dir" not in d
    again = load_recipe(json.loads(json.dumps(d)))
    assert again == r
    assert again.to_dict() == d
    assert load_recipe(Recipe().to_dict()) == Recipe()


@pytest.mark.parametrize(
    ("advantage", "scale", "expected"),
    [
        ("grpo", None, ("group_mean", "group")),
        ("grpo", "none", ("group_mean", "none")),
        ("dr_grpo", None, ("group_mean", "none")),
        ("rloo", None, ("leave_one_out", "none")),
        ("rloo", "batch", ("leave_one_out", "batch")),
        ("reinforce_pp", None, ("batch_mean", "batch")),
    ],
)
def test_advantage_estimator_and_scale(advantage, scale, expected):
    recipe = load_recipe({"algorithm": {"advantage": advantage, "scale_rewards": scale}})
    assert recipe.advantage_baseline_and_scale == expected


def test_dr_grpo_with_a_scale_is_a_contradiction():
    with pytest.raises(
        UserError, match='algorithm.scale_rewards: "group" contradicts advantage "dr_grpo"'
    ):
        load_recipe({"algorithm": {"advantage": "dr_grpo", "scale_rewards": "group"}})


def test_vllm_scheduler_limits_are_checked_before_vllm_sees_them():
    """vLLM's own rule (batched tokens >= sequences an engine step), said before any model loads;
    the other engines ignore the keys."""
    err = error_of(
        {"rollout": {"engine": "vllm"}},
        ["rollout.vllm_max_num_seqs=2048", "rollout.vllm_max_num_batched_tokens=1024"],
    )
    assert err.where == "rollout.vllm_max_num_batched_tokens"
    assert "1024 is less than rollout.vllm_max_num_seqs 2048" in err.what
    assert "at least 2048" in err.fix
    for engine, tokens in (("vllm", 2048), ("hf", 1024)):
        load_recipe(
            {
                "rollout": {
                    "engine": engine,
                    "vllm_max_num_seqs": 2048,
                    "vllm_max_num_batched_tokens": tokens,
                }
            }
        )
