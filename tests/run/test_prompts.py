"""Prompt loading, row checks and deterministic sampling."""

import json

import datasets
import pytest

from grpo_ds.config.recipe import DataConfig
from grpo_ds.errors import UserError
from grpo_ds.model.tiny import build_tiny_tokenizer
from grpo_ds.run.prompts import (
    BUILTIN_DATASETS,
    PromptRow,
    PromptSampler,
    load_rows,
    prepare_prompts,
)

ROWS = [
    {"prompt": "1+2=", "answer": "3"},
    {"prompt": "2+2=", "answer": "4"},
    {"prompt": "0+0=", "answer": "0"},
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ loading


def test_builtin_arith():
    rows = load_rows(DataConfig(train="builtin:arith"))
    assert len(rows) == 25
    assert rows == BUILTIN_DATASETS["arith"]()
    assert len({r["prompt"] for r in rows}) == 25
    for r in rows:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["answer"] == str(int(a) + int(b))
        assert len(r["answer"]) == 1 and 0 <= int(r["answer"]) <= 8


def test_unknown_builtin_suggests():
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train="builtin:arithm"))
    assert err.value.where == "data.train" and "builtin:arith" in err.value.fix


def test_jsonl_round_trip(tmp_path):
    assert load_rows(DataConfig(train=str(write_jsonl(tmp_path / "d.jsonl", ROWS)))) == ROWS


def test_json_round_trip(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    assert load_rows(DataConfig(train=str(tmp_path / "d.json"))) == ROWS


def test_parquet_round_trip(tmp_path):
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(DataConfig(train=str(tmp_path / "d.parquet"))) == ROWS


def test_saved_dataset_folder(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(DataConfig(train=str(tmp_path / "ds"))) == ROWS


def test_saved_dataset_dict_uses_train_split(tmp_path):
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(DataConfig(train=str(tmp_path / "dd"))) == ROWS


def test_relative_path_falls_back_to_recipe_folder(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    write_jsonl(recipe_dir / "d.jsonl", ROWS[:1])
    monkeypatch.chdir(tmp_path)
    assert load_rows(DataConfig(train="d.jsonl"), source_dir=str(recipe_dir)) == ROWS[:1]
    write_jsonl(tmp_path / "d.jsonl", ROWS[1:2])  # the working directory wins when both exist
    assert load_rows(DataConfig(train="d.jsonl"), source_dir=str(recipe_dir)) == ROWS[1:2]


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",\n{"prompt": "c"}\n')
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train=str(path)))
    assert err.value.where == f"{path}:3"
    assert "invalid JSON" in err.value.what


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train=str(path)))
    assert err.value.where == f"{path}:2" and "list" in err.value.what


def test_malformed_json_and_parquet(tmp_path):
    (tmp_path / "bad.json").write_text('[{"prompt": "a"},')
    (tmp_path / "bad.parquet").write_text("not parquet")
    for name in ("bad.json", "bad.parquet"):
        with pytest.raises(UserError) as err:
            load_rows(DataConfig(train=str(tmp_path / name)))
        assert err.value.where == str(tmp_path / name) and "cannot read" in err.value.what


def test_missing_file(tmp_path):
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train="nope.jsonl"), source_dir=str(tmp_path))
    assert err.value.where == "data.train"
    assert err.value.what.startswith("nope.jsonl not found")


def test_hub_keys_are_refused_for_a_local_dataset_or_a_builtin(tmp_path):
    """data.train_config and data.train_revision pick a Hub dataset's configuration and revision:
    given with a local file or a builtin they would pick nothing."""
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train=path, train_config="main"))
    assert err.value.where == "data.train_config" and "is not a Hub id" in err.value.what
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train="builtin:arith", train_revision="v1"))
    assert err.value.where == "data.train_revision" and "is not a Hub id" in err.value.what


def test_unsupported_extension_and_plain_folder(tmp_path):
    (tmp_path / "d.csv").write_text("prompt\na\n")
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train=str(tmp_path / "d.csv")))
    assert "'.csv'" in err.value.what
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as err:
        load_rows(DataConfig(train=str(tmp_path / "empty")))
    assert "not a saved HF dataset" in err.value.what


# ------------------------------------------------------------------------------------------ prompts


def test_prepare_prompts_good_rows(tok):
    good, skipped = prepare_prompts(ROWS, DataConfig(), tok, "data.train")
    assert skipped == 0
    assert [p.index for p in good] == [0, 1, 2]
    assert good[0] == PromptRow(
        index=0, prompt_text="1+2=", prompt_ids=tok("1+2=")["input_ids"], columns=ROWS[0]
    )
    assert tok.decode(good[1].prompt_ids) == "2+2="


def test_missing_prompt_key_error_names_row(tok):
    rows = [ROWS[0], {"question": "x", "answer": "1"}, ROWS[1]]
    with pytest.raises(UserError) as err:
        prepare_prompts(rows, DataConfig(), tok, "d.jsonl")
    assert err.value.where == "d.jsonl row 2"
    assert err.value.what == "no 'prompt' key (keys: question, answer)"
    assert "data.prompt_key" in err.value.fix and 'on_bad_row="skip"' in err.value.fix


def test_missing_key_in_jsonl_file(tmp_path, tok):
    # datasets fills a missing column with None; that must read as a missing key too.
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"question": "x", "answer": "1"}])
    with pytest.raises(UserError) as err:
        prepare_prompts(load_rows(DataConfig(train=str(path))), DataConfig(), tok, str(path))
    assert err.value.where == f"{path} row 2" and "no 'prompt' key" in err.value.what


def test_skip_counts_bad_rows(tok):
    rows = [
        {"question": "x"},
        ROWS[0],
        {"prompt": "   "},
        {"prompt": 7},
        {"prompt": "9" * 50},
        ROWS[1],
    ]
    good, skipped = prepare_prompts(
        rows, DataConfig(on_bad_row="skip", max_prompt_tokens=10), tok, "w"
    )
    assert skipped == 4
    assert [p.index for p in good] == [1, 5]
    assert [p.columns["answer"] for p in good] == ["3", "4"]


def test_too_long_prompt(tok):
    rows = [ROWS[0], {"prompt": "1234567"}]
    with pytest.raises(UserError) as err:
        prepare_prompts(rows, DataConfig(max_prompt_tokens=6), tok, "w")
    assert err.value.where == "w row 2"
    assert "7 tokens" in err.value.what and "max_prompt_tokens=6" in err.value.what
    assert "raise data.max_prompt_tokens" in err.value.fix
    # the limit is inclusive
    good, _ = prepare_prompts(rows, DataConfig(max_prompt_tokens=7), tok, "w")
    assert len(good) == 2


def test_empty_and_non_string_prompt(tok):
    with pytest.raises(UserError) as err:
        prepare_prompts([ROWS[0], ROWS[1], {"prompt": " \n"}], DataConfig(), tok, "w")
    assert err.value.where == "w row 3" and "empty" in err.value.what
    with pytest.raises(UserError) as err:
        prepare_prompts([{"prompt": ["a"]}], DataConfig(), tok, "w")
    assert err.value.where == "w row 1" and "not a string" in err.value.what


def test_first_bad_row_is_reported(tok):
    # row 2 is too long (found after tokenizing), row 3 lacks the key (found before): row 2 is
    # reported.
    rows = [ROWS[0], {"prompt": "1" * 20}, {"x": 1}]
    with pytest.raises(UserError) as err:
        prepare_prompts(rows, DataConfig(max_prompt_tokens=10), tok, "w")
    assert err.value.where == "w row 2"


def test_all_rows_bad_is_an_error_even_when_skipping(tok):
    with pytest.raises(UserError) as err:
        prepare_prompts([{"q": "a"}, {"q": "b"}], DataConfig(on_bad_row="skip"), tok, "w")
    assert err.value.where == "w" and "all 2 rows are bad" in err.value.what
    with pytest.raises(UserError):
        prepare_prompts([], DataConfig(), tok, "w")


def test_chat_template_applied(tok):
    good, _ = prepare_prompts(ROWS[:1], DataConfig(chat_template=True), tok, "w")
    expected = "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert good[0].prompt_text == expected
    assert good[0].prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert good[0].prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert good[0].columns == ROWS[0]  # the raw prompt stays in the columns


def test_chat_template_counts_toward_length(tok):
    # "1+2=" is 4 tokens, but 23 with the template.
    with pytest.raises(UserError) as err:
        prepare_prompts(ROWS[:1], DataConfig(chat_template=True, max_prompt_tokens=10), tok, "w")
    assert "23 tokens" in err.value.what


def test_chat_template_missing(tok):
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(UserError) as err:
        prepare_prompts(ROWS[:1], DataConfig(chat_template=True), bare, "w")
    assert err.value.where == "data.chat_template"


# ----------------------------------------------------------------------------------------- sampling


def test_sampler_is_deterministic_by_seed():
    a, b, c = (
        PromptSampler(10, seed=1, shuffle=True),
        PromptSampler(10, 1, True),
        PromptSampler(10, 2, True),
    )
    seq = a.next_indices(25)
    assert seq == b.next_indices(25)
    assert seq != c.next_indices(25)
    assert seq[:10] != list(range(10))  # actually shuffled


def test_sampler_epochs_cover_every_index_once():
    sampler = PromptSampler(7, seed=0, shuffle=True)
    # 15 draws cross two epoch boundaries
    seq = [i for _ in range(5) for i in sampler.next_indices(3)]
    assert sorted(seq[:7]) == list(range(7)) and sorted(seq[7:14]) == list(range(7))
    assert seq[:7] != seq[7:14]  # each epoch has its own permutation
    assert sampler.state_dict() == {"epoch": 2, "position": 1}


def test_sampler_wraps_several_epochs_in_one_call():
    sampler = PromptSampler(3, seed=0, shuffle=False)
    assert sampler.next_indices(8) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert sampler.next_indices(2) == [2, 0]


def test_sampler_resume_reproduces_continuation():
    full = PromptSampler(9, seed=5, shuffle=True)
    head = full.next_indices(13)
    state = full.state_dict()
    tail = full.next_indices(20)
    resumed = PromptSampler(9, seed=5, shuffle=True)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert resumed.next_indices(20) == tail
    assert head != tail[:13]


def test_sampler_rejects_state_that_does_not_fit():
    with pytest.raises(ValueError):
        PromptSampler(3, 0, True).load_state_dict({"epoch": 0, "position": 5})


def test_a_changed_dataset_continues_with_a_new_pass():
    sampler = PromptSampler(10, seed=1, shuffle=True)
    # 40 prompts before, 10 now
    sampler.load_state_dict({"epoch": 3, "position": 30}, data_changed=True)
    assert sampler.state_dict() == {"epoch": 4, "position": 0}
    fresh = PromptSampler(10, seed=1, shuffle=True)
    # at an epoch boundary: that epoch
    fresh.load_state_dict({"epoch": 2, "position": 0}, data_changed=True)
    assert fresh.state_dict() == {"epoch": 2, "position": 0}


def test_data_identity_names_what_changed(tmp_path):
    from grpo_ds.run.prompts import PromptRow, data_changes, data_identity, data_source

    rows = [PromptRow(i, f"{i}+1=", [i], {"answer": str(i + 1)}) for i in range(4)]
    (tmp_path / "d.jsonl").write_text("")
    source = data_source(DataConfig(train="d.jsonl"), str(tmp_path))
    now = data_identity(source, rows)
    assert now["prompts"] == 4 and now["source"] == str((tmp_path / "d.jsonl").resolve())
    # the same rows: no change
    assert data_changes(now, data_identity(source, rows)) is None
    assert data_changes(now, data_identity(source, rows[:1])) == "it held 4 prompts, now 1"
    # same length, one answer edited
    edited = rows[:3] + [PromptRow(3, "3+1=", [3], {"answer": "5"})]
    assert "its 4 prompts differ (fingerprint" in data_changes(now, data_identity(source, edited))
    # a Hub dataset is named by its id, configuration, split and revision (not fetched for this)
    hub = DataConfig(train="openai/gsm8k", train_config="main", train_revision="v1")
    assert data_source(hub, str(tmp_path)) == (
        "openai/gsm8k on the Hugging Face Hub (config main, split train, revision v1)"
    )
