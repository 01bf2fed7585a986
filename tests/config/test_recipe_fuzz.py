"""Fuzzing the recipe loader: whatever JSON a user writes for whatever key, and whatever override
string they type, ``load_recipe`` returns a valid recipe or raises one clean UserError line, never
another exception.

Every key of the schema (grpo_ds.config.recipe.iter_fields) is exercised twice: once by a fixed
table of hostile values, and by hypothesis, which draws a few keys per example with random JSON
values (NaN and infinities included), values near each key's declared range and choices, and random
``section.key=value`` strings. Bounded for CI (``GRPO_DS_FUZZ_EXAMPLES``, default 150);
deterministic (derandomized) so a CI failure reproduces.
"""

import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_ds.config.loading import load_recipe
from grpo_ds.config.recipe import Recipe, iter_fields
from grpo_ds.errors import UserError

KEYS = [(section, f) for section, f in iter_fields()]
DOTTED = [f"{section}.{f.name}" if section else f.name for section, f in KEYS]
EXAMPLES = int(os.environ.get("GRPO_DS_FUZZ_EXAMPLES", "150"))
HOSTILE = [
    None,
    True,
    0,
    -1,
    2**70,
    -(2**70),
    0.5,
    -1e-300,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    "",
    " ",
    "x" * 300,
    "\0",
    "../..",
    [],
    [math.nan],
    [None, {}],
    {},
    {"a": math.inf},
    [[[[1]]]],
]


def outcome(source, overrides=None) -> Recipe | UserError:
    """The loader's result: a Recipe, or the UserError it raised (checked to be one clean line);
    anything else propagates and fails the test with its traceback."""
    try:
        recipe = load_recipe(source, overrides)
    except UserError as err:
        text = str(err)
        assert "\n" not in text and "\r" not in text, repr(text)
        assert err.where and err.what, repr(text)
        assert "Traceback" not in text
        return err
    assert isinstance(recipe, Recipe)
    return recipe


def _set(raw: dict, dotted: str, value) -> None:
    section, _, name = dotted.partition(".")
    if name:
        raw.setdefault(section, {})[name] = value
    else:
        raw[section] = value


def test_every_key_is_fuzzed():
    assert len(KEYS) == len(set(DOTTED)) > 50 and "deepspeed" in DOTTED


@pytest.mark.parametrize("key", DOTTED)
def test_hostile_values_for_every_key(key):
    """Each hostile value for the key, in a recipe, as an override string and as a Python override;
    NaN and infinity are always refused."""
    for value in HOSTILE:
        raw: dict = {}
        _set(raw, key, value)
        result = outcome(raw)
        if isinstance(value, float) and not math.isfinite(value):
            # as a non-finite or as the wrong type
            assert isinstance(result, UserError), (key, value, result)
        outcome({}, [f"{key}={json.dumps(value)}"])
        outcome({}, {key: value})


def _near(section, f) -> st.SearchStrategy:
    """Values a user might plausibly write for this key: its default, its choices, its bounds and
    just past them."""
    meta = f.metadata
    default = f.default_factory() if callable(getattr(f, "default_factory", None)) else f.default
    values = [default] if not isinstance(default, type) else []
    values += list(meta.get("choices") or ())
    for bound in (meta.get("low"), meta.get("high")):
        if bound is not None:
            values += [bound, bound - 1, bound + 1, bound * 2, bound - 1e-9]
    return st.sampled_from(values) if values else st.none()


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)


@st.composite
def recipes(draw):
    raw: dict = {}
    for index in draw(st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=6)):
        section, f = KEYS[index]
        value = draw(JSON_VALUES | _near(section, f) | st.integers(1, 64))
        _set(raw, DOTTED[index], value)
    # sometimes a whole section, or the top level, is the wrong kind of value
    if draw(st.booleans()):
        raw[draw(st.sampled_from(sorted({d.partition(".")[0] for d in DOTTED}) + ["nope"]))] = draw(
            JSON_VALUES
        )
    return raw


OVERRIDES = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(
                DOTTED + ["train", "train.", ".lr", "deepspeed.zero_optimization.stage", "a.b.c"]
            ),
            st.one_of(st.text(max_size=12), JSON_VALUES.map(lambda v: json.dumps(v))),
        ).map("=".join),
        st.text(max_size=30),
    ),
    max_size=4,
)


@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(raw=recipes(), overrides=OVERRIDES)
def test_random_recipes_and_overrides_give_a_recipe_or_one_error_line(raw, overrides):
    outcome(raw, overrides)


@settings(
    max_examples=max(EXAMPLES // 3, 10),
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_random_recipe_files_give_a_recipe_or_one_error_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "recipe.json"
    path.write_bytes(data)
    outcome(path)


# -------------------------------------------------------------------------------- beyond the loader

STRING_KEYS = [
    d for d, (section, f) in zip(DOTTED, KEYS, strict=True) if "str" in str(f.type) and section
]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> list[str]:
    """Path-like values: files, folders, empty data, odd characters, places that cannot be
    written."""
    base = tmp_path_factory.mktemp("places")
    (base / "file").write_text("x")
    (base / "empty.jsonl").write_text("")
    (base / "list.json").write_text("[]")
    (base / "folder").mkdir()
    return [str(base / n) for n in ("file", "file/below", "empty.jsonl", "list.json", "folder")] + [
        "",
        ".",
        "..",
        "/",
        "/proc/1",
        "\n",
        "a\nb",
        "x\0y",
        "~",
        "builtin:",
        "builtin:nope",
        "ds_configs/zero3.json",
    ]


@settings(
    max_examples=max(EXAMPLES // 3, 10),
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_random_paths_through_prepare_inputs(places, tmp_path_factory, data):
    """The whole validation before load (grpo_ds.run.preflight), string keys set to path-like
    values: a valid input or one error line, and nothing written either way."""
    from grpo_ds.run.preflight import prepare_inputs

    out = tmp_path_factory.mktemp("out")
    overrides = data.draw(
        st.dictionaries(
            st.sampled_from(STRING_KEYS + ["deepspeed"]),
            st.sampled_from(places) | st.text(max_size=6),
            max_size=3,
        )
    )
    if overrides.get("run.output_dir") in (None, "", ".", "/", "~"):
        # never the working directory: nothing may be written
        overrides["run.output_dir"] = str(out / "runs")
    raw = {"rollout": {"max_new_tokens": 2, "prompts_per_step": 2, "group_size": 2}}
    try:
        prepare_inputs(raw, overrides, 1, "cpu")
    except UserError as err:
        assert "\n" not in str(err) and err.where, repr(str(err))
    assert not any(out.iterdir())
