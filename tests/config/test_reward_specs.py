"""The entries of reward.functions and reward.models (grpo_ds.config.reward_specs): each key's check
as its declaration says, the defaults, the recipe reference documenting every entry key from that
same declaration, and one parser: the recipe's reward section is parsed once, and every reader
shares its specs. The folders' checks are tests/model/test_reward_model_checks.py's."""

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from grpo_ds.check import report
from grpo_ds.config import reward_specs
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.reference import definitions
from grpo_ds.config.reward_specs import RewardFunctionSpec, RewardModelSpec, parse_rewards
from grpo_ds.errors import UserError
from grpo_ds.run.preflight import prepare_inputs
from tests.reward_models.builders import write_reward_model

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "recipe.md"


def models(entries: list) -> tuple[RewardModelSpec, ...]:
    return parse_rewards([], entries).models


def test_defaults_and_the_name_from_the_folder():
    (spec,) = models([{"path": " models/helpful_rm/ "}])
    assert spec == RewardModelSpec(
        path="models/helpful_rm/",
        name="helpful_rm",
        weight=1.0,
        chat_template=True,
        max_length=None,
        overflow="truncate_left",
        mean=0.0,
        std=1.0,
        offload=False,
    )
    assert RewardModelSpec(path="a/b").name == "b"  # built in code too, the name is never missing


def test_every_key_given():
    entry = {
        "path": "rm",
        "revision": "v2",
        "name": "safety",
        "weight": -2,
        "chat_template": False,
        "max_length": 64,
        "overflow": "error",
        "mean": 0.5,
        "std": 2,
        "offload": True,
    }
    (spec,) = models([entry])
    assert dataclasses.asdict(spec) == {**entry, "weight": -2.0, "std": 2.0}
    # integers widened, as recipe numbers are
    assert isinstance(spec.weight, float) and isinstance(spec.std, float)


def test_a_recipe_with_models_and_no_functions_loads():
    recipe = load_recipe(
        {}, ["reward.functions=[]", 'reward.models=[{"path": "rm", "weight": 0.5}]']
    )
    assert reward_specs.reward_specs(recipe.reward).models[0].weight == 0.5


@pytest.mark.parametrize(
    ("entry", "where", "what"),
    [
        ("rm", "reward.models[0]", "must be an object with a string path"),
        ({"weight": 1.0}, "reward.models[0]", "must be an object with a string path"),
        ({"path": "  "}, "reward.models[0]", "must be an object with a string path"),
        ({"path": "rm", "wieght": 1}, "reward.models[0].wieght", "unknown key"),
        ({"path": "rm", "name": 3}, "reward.models[0].name", "expected a string, got an integer 3"),
        ({"path": "rm", "name": " "}, "reward.models[0].name", "is empty"),
        (
            {"path": "rm", "weight": "1"},
            "reward.models[0].weight",
            'expected a number, got a string "1"',
        ),
        (
            {"path": "rm", "weight": float("inf")},
            "reward.models[0].weight",
            "Infinity is not a finite number",
        ),
        (
            {"path": "rm", "chat_template": 1},
            "reward.models[0].chat_template",
            "expected a boolean, got an integer 1",
        ),
        (
            {"path": "rm", "max_length": 1},
            "reward.models[0].max_length",
            "1 is out of range: must be >= 2",
        ),
        (
            {"path": "rm", "max_length": 8.5},
            "reward.models[0].max_length",
            "expected an integer, got a number 8.5",
        ),
        (
            {"path": "rm", "overflow": "truncate"},
            "reward.models[0].overflow",
            "'truncate' is not one of",
        ),
        ({"path": "rm", "mean": None}, "reward.models[0].mean", "must not be null"),
        ({"path": "rm", "std": 0}, "reward.models[0].std", "0.0 is out of range: must be > 0"),
        ({"path": "rm", "std": -1.0}, "reward.models[0].std", "is out of range: must be > 0"),
        (
            {"path": "rm", "offload": "yes"},
            "reward.models[0].offload",
            'expected a boolean, got a string "yes"',
        ),
    ],
)
def test_each_bad_entry_is_one_error_at_its_key(entry, where, what):
    with pytest.raises(UserError) as info:
        models([entry])
    assert info.value.where == where
    assert what in info.value.what
    assert info.value.fix  # every message says what to do


def test_the_index_of_the_bad_entry_is_named_and_the_fix_suggests_a_value():
    with pytest.raises(UserError) as info:
        models([{"path": "a"}, {"path": "b", "max_length": "long"}])
    assert (info.value.where, info.value.fix) == ("reward.models[1].max_length", "e.g. 1024")
    with pytest.raises(UserError) as info:
        models([{"path": "a", "overflow": "truncate_lft"}])
    assert "truncate_left" in info.value.fix


def test_two_models_with_one_name_are_refused():
    with pytest.raises(UserError) as info:
        models([{"path": "x/rm"}, {"path": "y/rm"}])  # both default to the folder's name
    assert info.value.where == "reward.models[1].name" and "reward.models[0]" in info.value.what
    assert [s.name for s in models([{"path": "x/rm"}, {"path": "y/rm", "name": "rm2"}])] == [
        "rm",
        "rm2",
    ]


def test_a_bad_entry_stops_the_recipe_load():
    with pytest.raises(UserError) as info:
        load_recipe({}, ['reward.models=[{"path": "rm", "std": 0}]'])
    assert info.value.where == "reward.models[0].std"


# ------------------------------------------------------------------------------------ the reference


def _entry_definitions(text: str) -> dict[str, tuple[str, str]]:
    """`reward.models[].key` -> (its meaning, its facts line) from the reference's definitions."""
    found = re.findall(
        r"^`reward\.models\[\]\.(\w+)`\{#reward\.models\.\w+\}\n:   (.+)\n\n    (.+)$",
        text,
        flags=re.MULTILINE,
    )
    return {key: (meaning, facts) for key, meaning, facts in found}


def test_the_reference_documents_every_entry_key_with_its_type_default_and_range():
    page = REFERENCE.read_text(encoding="utf-8")
    # the page is the generator's text (tests/test_docs.py checks it whole)
    assert definitions() in page
    documented = _entry_definitions(page)
    assert list(documented) == [f.name for f in dataclasses.fields(RewardModelSpec)]
    for f in dataclasses.fields(RewardModelSpec):
        meaning, facts = documented[f.name]
        assert meaning == f.metadata["doc"]
    assert documented["path"][1] == "string · required"
    assert documented["name"][1] == "string or null · default `null`"
    assert documented["max_length"][1] == "int or null · default `null` · >= 2"
    assert (
        documented["overflow"][1]
        == 'string · default `"truncate_left"` · one of `"truncate_left"`, `"error"`'
    )
    assert documented["std"][1] == "float · default `1.0` · > 0"
    assert documented["offload"][1] == f"bool · default `{json.dumps(RewardModelSpec.offload)}`"
    # after the reward section's own keys, before the next section
    assert (
        page.index("`reward.models`{#reward.models}\n")
        < page.index("### `reward.models[]`")
        < page.index("## `algorithm`")
    )


def test_a_model_named_like_a_reward_function_is_refused():
    from grpo_ds.config.loading import load_recipe

    with pytest.raises(UserError) as err:
        load_recipe(
            {"reward": {"functions": [{"name": "format"}], "models": [{"path": "m/format"}]}}
        )
    assert str(err.value).startswith(
        'reward.models[0].name: "format" is the name of a reward function too'
    )
    load_recipe(
        {
            "reward": {
                "functions": [{"name": "format"}],
                "models": [{"path": "m/format", "name": "rm"}],
            }
        }
    )


# ------------------------------------------------------------------------------------- one parser


def test_function_entries_are_stripped_and_get_the_default_weight():
    specs = parse_rewards([{"name": " format "}, {"name": "exact_match", "weight": 2}], [])
    assert specs.functions == (
        RewardFunctionSpec("format", 1.0),
        RewardFunctionSpec("exact_match", 2.0),
    )
    assert isinstance(specs.functions[1].weight, float) and specs.models == ()


def test_the_recipe_is_parsed_once_and_every_reader_shares_the_specs(tmp_path, monkeypatch):
    """Loading the recipe (its rules), the preflight (the functions loaded, the models' folders
    checked and handed on to the scorers) and the dry run's report (the memory estimate, a line per
    model) all read one parse of reward.functions and reward.models."""
    calls = []
    parse = reward_specs.parse_rewards
    monkeypatch.setattr(
        reward_specs, "parse_rewards", lambda *entries: calls.append(entries) or parse(*entries)
    )
    folder = write_reward_model(tmp_path / "helpful_rm")
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f'reward.models=[{{"path": "{folder}", "weight": 0.5}}]',
    ]
    inputs = prepare_inputs(REPO / "recipes" / "tiny_cpu.json", overrides, 1, "cpu")
    dry_run = report(inputs, 1, "max")
    specs = reward_specs.reward_specs(inputs.recipe.reward)
    assert len(calls) == 1
    assert inputs.reward_models is specs.models  # what the session hands RewardModels.build
    assert [(f.name, f.weight) for f in inputs.reward_functions] == [("exact_match", 1.0)]
    assert specs.models[0].weight == 0.5 and f"helpful_rm: {folder}" in dry_run


SPEC_TYPES = {"parse_rewards", "RewardSpecs", "RewardFunctionSpec", "RewardModelSpec"}


def test_nothing_else_in_the_package_parses_or_builds_reward_specs():
    """The specs are built in grpo_ds/config/reward_specs.py alone: no other module of the package
    calls the parser or a spec type's constructor (the tests may build specs in code)."""
    for path in sorted((REPO / "grpo_ds").rglob("*.py")):
        where = str(path.relative_to(REPO))
        if where == "grpo_ds/config/reward_specs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            assert called not in SPEC_TYPES, f"{where}:{node.lineno} calls {called}"
