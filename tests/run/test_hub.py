"""Models and datasets named by a Hugging Face Hub id (grpo_ds/run/hub.py, grpo_ds/run/hub_data.py):
the tiny recipe trains from a Hub model and a Hub dataset on one rank in process and on two ranks
through the launcher (one download per file), the dry run fetches no weights, and every refusal is
one line and exit 2.

No test reaches the network: the repositories are served by a Hub on the loopback
(tests/hub_mirror.py says why a mirror rather than a cache laid out by hand) into a Hugging Face
cache of the test's own (HF_HOME). In process, huggingface_hub's settings, read from the environment
when it was first imported, are set on its ``constants`` module (ENDPOINT and the URL template built
from it, the cache, offline); a process the test starts gets them as environment variables.
"""

import importlib
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import grpo_ds
from grpo_ds.errors import UserError
from grpo_ds.export import export_checkpoint
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.reward_models.tiny import write_digit_reward_model
from grpo_ds.run import hub
from grpo_ds.run.hub import hub_repo
from tests.hub_mirror import HubMirror
from tests.launch import REPO, clean_env, free_port, launch_command, remove_shm_buffers
from tests.scripts.cli_forks import run_forked

TINY = str(REPO / "recipes" / "tiny_cpu.json")
MODEL, DATASET, REWARD_MODEL = "tiny-org/tiny-llama", "tiny-org/arith", "tiny-org/digit7-rm"
GATED, PRIVATE = "tiny-org/gated-llama", "tiny-org/private-llama"
# the model's files as save_pretrained writes them (transformers 5)
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: other
  data_files: other/*.parquet
---
# arith: one-digit sums
"""


def _small(tmp_path, **overrides) -> dict:
    """The tiny recipe, two short steps, reading the Hub model and the Hub dataset."""
    return {
        "run.output_dir": str(tmp_path / "runs"),
        "model.path": MODEL,
        "data.train": DATASET,
        "data.train_config": "main",
        "train.steps": 2,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 8,
        "train.logprob_micro_batch_samples_per_gpu": 8,
        "logging.progress_bar": False,
        **overrides,
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The repositories' files: a tiny model saved as transformers saves one, with its tokenizer,
    and a dataset with two configurations (main: train and test splits)."""
    root = tmp_path_factory.mktemp("repos")
    tokenizer = build_tiny_tokenizer()
    model = root / "model"
    build_tiny_model(
        len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, seed=3
    ).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = root / "data"
    for split, rows in (("main/train", ROWS), ("main/test", ROWS[:5]), ("other/all", ROWS[:3])):
        (data / split).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), data / f"{split}-00000-of-00001.parquet")
    (data / "README.md").write_text(CARD)
    return {"model": model, "data": data, "rm": write_digit_reward_model(root / "rm")}


@pytest.fixture
def mirror(folders):
    with HubMirror() as served:
        served.add("model", MODEL, folders["model"])
        served.add("model", MODEL, folders["model"], branch="v1")
        served.add("model", GATED, folders["model"], gated=True)
        served.add("model", PRIVATE, folders["model"], private=True)
        served.add("dataset", DATASET, folders["data"])
        served.add("model", REWARD_MODEL, folders["rm"])
        yield served


@pytest.fixture
def hub_env(mirror, tmp_path, monkeypatch):
    """This process and the ones it starts read the mirror into tmp_path/hf (no token)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    for name, value in (
        ("ENDPOINT", mirror.url),
        ("HUGGINGFACE_CO_URL_TEMPLATE", mirror.url + "/{repo_id}/resolve/{revision}/{filename}"),
        ("HF_HUB_CACHE", str(cache / "hub")),
        ("HF_HUB_OFFLINE", False),
    ):
        monkeypatch.setattr(constants, name, value)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache / "datasets"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", mirror.url)
    return cache


# ------------------------------------------------------------------------------------- the ids


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    as_id = lambda spec, kind="model": hub_repo("k", spec, kind, None, "k_revision") is not None
    assert as_id("Qwen/Qwen2.5-1.5B-Instruct") and as_id("openai/gsm8k", "dataset")
    for path in ("builtin:tiny", "/models/x", "./a/b", "a/b/c", "a", "a--b/c", "a/b..c", "-a/b"):
        assert not as_id(path), path
    assert as_id("data/train.jsonl") and not as_id("data/train.jsonl", "dataset")  # a file's name
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not as_id("owner/name")  # a local folder of that name wins
    with pytest.raises(UserError) as err:
        hub_repo("model.path", "builtin:tiny", "model", "main", "model.revision")
    assert str(err.value) == (
        "model.revision: 'main' picks a revision of a Hugging Face Hub repository, but "
        "model.path builtin:tiny is not a Hub id. set model.revision to null for a local path or "
        "a builtin."
    )


def test_a_marker_counts_only_when_this_launch_wrote_it(tmp_path):
    """The node's waiting ranks read local rank 0's marker; one an earlier launch left (written
    before this launcher started) is never read."""
    marker = tmp_path / "m.json"
    hub._tell(marker, {"folder": "/cache/snapshot"})
    written = json.loads(marker.read_text())["written"]
    assert hub._read(marker, started=written + 1) is None
    assert str(hub._read(marker, started=written - 1)) == "/cache/snapshot"
    hub._tell(marker, {"error": ["model.path", "what", "fix"]})
    with pytest.raises(UserError, match="^model.path: what. fix.$"):
        hub._read(marker, started=0.0)
    started = hub._launch_started()  # pytest's parent process
    assert started is not None and started < time.time()


def test_download_bars_show_on_a_terminal_only(monkeypatch):
    """huggingface_hub's progress bars where stderr is a terminal; none in a log, and afterwards
    they are as they were."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module, not the class

    for module in (constants, hub_tqdm):  # HF_HUB_DISABLE_PROGRESS_BARS unset (tqdm holds a copy)
        monkeypatch.setattr(module, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    assert not are_progress_bars_disabled()
    for terminal in (False, True):
        monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal)
        with hub.progress_bars():
            assert are_progress_bars_disabled() is not terminal
        assert not are_progress_bars_disabled()


# ------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_the_tiny_recipe_trains_from_a_hub_model_and_dataset_in_process(hub_env, mirror, tmp_path):
    """One rank in this process: the model and the dataset come from the mirror through the cache,
    the run folder records the ids (not the cache folder), and, offline, the same command reads the
    cache alone and finds the finished run (its recipe the same, ids and all), and the export
    rebuilds the model from the id."""
    reward_model = {"reward.models": [{"path": REWARD_MODEL, "weight": 0.1}]}
    metrics = grpo_ds.train(TINY, _small(tmp_path, **reward_model))
    assert len(metrics) == 2 and all("reward/digit7-rm" in m for m in metrics)
    run = tmp_path / "runs" / "tiny_cpu"
    recipe = json.loads((run / "recipe.json").read_text())
    assert recipe["model"]["path"] == MODEL and recipe["data"]["train"] == DATASET
    data = json.loads((run / "data.json").read_text())
    assert data["source"] == f"{DATASET} on the Hugging Face Hub (config main, split train)"
    assert data["prompts"] == len(ROWS)
    assert {f: mirror.downloads(MODEL, f) for f in MODEL_FILES} == dict.fromkeys(MODEL_FILES, 1)
    assert mirror.downloads(REWARD_MODEL, "model.safetensors") == 1
    assert mirror.downloads(DATASET, "main/train-00000-of-00001.parquet") == 1
    assert mirror.downloads(DATASET, "other/all-00000-of-00001.parquet") == 0  # another config
    snapshots = hub_env / "hub" / "models--tiny-org--tiny-llama" / "snapshots"
    assert (next(snapshots.iterdir()) / "model.safetensors").is_file()

    from huggingface_hub import constants

    requests = len(mirror.requests)
    constants.HF_HUB_OFFLINE = True  # reset by hub_env's monkeypatch
    again = grpo_ds.train(TINY, _small(tmp_path, **reward_model))  # finished: nothing run
    assert [m["step"] for m in again] == [m["step"] for m in metrics]
    # the export rebuilds the model from the id in recipe.json, through the cache
    exported = export_checkpoint(run, tmp_path / "exported")
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    assert len(mirror.requests) == requests


@pytest.mark.slow
def test_two_ranks_train_from_hub_ids_and_the_node_downloads_each_file_once(
    hub_env, mirror, tmp_path
):
    """Two ranks through DeepSpeed's launcher: local rank 0 fetches while rank 1 waits for its
    marker, so only rank 0 asks the Hub and each file crosses the network once; the model at a
    named revision."""
    port = free_port()
    command = launch_command(
        2,
        [
            "--module",
            "grpo_ds.train",
            TINY,
            *(
                f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                for k, v in _small(tmp_path).items()
            ),
            "model.revision=v1",
        ],
        port,
    )
    env = clean_env() | {"HF_HOME": str(hub_env), "HF_ENDPOINT": mirror.url}
    try:
        proc = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run = tmp_path / "runs" / "tiny_cpu"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((run / "recipe.json").read_text())["model"]["revision"] == "v1"
    assert {f: mirror.downloads(MODEL, f) for f in MODEL_FILES} == dict.fromkeys(MODEL_FILES, 1)
    assert mirror.downloads(DATASET, "main/train-00000-of-00001.parquet") == 1
    # only local rank 0 asked the Hub: rank 1 read its marker
    assert mirror.requests.count(("GET", f"/api/models/{MODEL}/revision/v1")) == 1
    assert mirror.requests.count(("HEAD", f"/datasets/{DATASET}/resolve/main/README.md")) == 1
    markers = list((hub_env / "hub" / ".locks" / "grpo_ds").glob("*.json"))
    assert len(markers) == 2  # the model's and the dataset's, written by local rank 0


# ------------------------------------------------------------------------------ one-line refusals


def _check(*overrides: str) -> list[str]:
    return ["grpo_ds.check", TINY, "run.output_dir={dir}/out", *overrides]


def _train(*overrides: str) -> list[str]:
    return ["grpo_ds.train", TINY, "run.output_dir={dir}/out", *overrides]


# name -> (argv after `python -m`, where, the start of <what>)
ONLINE = {
    "no_such_model": (
        _check(f"model.path={MODEL}-nope"),
        "model.path",
        f"{MODEL}-nope is not a local folder, and the Hugging Face Hub has no model of that name",
    ),
    "private": (
        _check(f"model.path={PRIVATE}"),
        "model.path",
        f"{PRIVATE} is not a local folder, and the Hugging Face Hub has no model of that name (or "
        "it is private, and no token given may read it)",
    ),
    "gated": (
        _check(f"model.path={GATED}"),
        "model.path",
        f"{GATED} is a gated model on the Hugging Face Hub, and no token with access to it",
    ),
    "no_such_revision": (
        _train(f"model.path={MODEL}", "model.revision=v9"),
        "model.revision",
        f"'v9' is not a branch, tag or commit of the model {MODEL} on the Hugging Face Hub",
    ),
    "no_such_reward_model": (
        _check(f'reward.models=[{{"path": "{MODEL}-rm"}}]'),
        "reward.models[0].path",
        f"{MODEL}-rm is not a local folder, and the Hugging Face Hub has no model",
    ),
    "no_such_dataset": (
        _check(f"data.train={DATASET}-nope"),
        "data.train",
        f"{DATASET}-nope is not a local file or folder, and the Hugging Face Hub has no dataset",
    ),
    "no_such_column": (
        _train(f"data.train={DATASET}", "data.train_config=main", "data.prompt_key=question"),
        f"data.train {DATASET} row 1",
        "no 'question' key (keys: prompt, answer)",
    ),
    "no_configuration_named": (
        _check(f"data.train={DATASET}"),
        "data.train_config",
        f"the dataset {DATASET} has 2 configurations (main, other) and names none its default",
    ),
    "no_such_configuration": (
        _check(f"data.train={DATASET}", "data.train_config=mian"),
        "data.train_config",
        f"'mian' is not a configuration of the dataset {DATASET}. did you mean 'main'?",
    ),
    "no_such_eval_split": (
        _check(f"eval.data={DATASET}", "eval.data_config=main", "eval.data_split=validation"),
        "eval.data_split",
        f"'validation' is not a split of {DATASET} (configuration main)",
    ),
}
# with HF_HUB_OFFLINE=1 and an empty cache
OFFLINE = {
    "offline_model": (
        _train(f"model.path={MODEL}"),
        "model.path",
        f"{MODEL} is not a local folder, and the Hugging Face cache",
    ),
    "offline_dataset": (
        _check(f"data.train={DATASET}", "data.train_config=main"),
        "data.train",
        f"{DATASET} is not a local file or folder, and the Hugging Face cache",
    ),
}


def _run_cases(cases: dict, env: dict, tmp_path) -> dict:
    commands = []
    for name, (argv, _, _) in cases.items():
        workdir = tmp_path / name
        workdir.mkdir()
        commands.append(([a.replace("{dir}", str(workdir)) for a in argv], workdir))
    finished = run_forked(commands, env, tmp_path / "_forks")
    return dict(zip(cases, finished, strict=True))


def _assert_one_line(finished, where: str, what: str) -> None:
    assert finished.returncode == 2, finished.stderr
    assert finished.stdout == ""
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}: {what}"), finished.stderr


@pytest.mark.slow
def test_each_refusal_is_one_line_and_exit_2(hub_env, mirror, tmp_path):
    """No such repository (a private one without a token reads the same), a gated one without
    access, an unknown revision, a dataset without the prompt column, configuration or split, each
    through the command lines; and the dry run of a Hub model and a Hub reward model fetches their
    configs and tokenizers but not their weights."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    dry_run = _check(f"model.path={MODEL}", f'reward.models=[{{"path": "{REWARD_MODEL}"}}]')
    cases = {**ONLINE, "dry_run": (dry_run, "", "")}
    results = _run_cases(cases, env, tmp_path)
    for name, (_, where, what) in ONLINE.items():
        _assert_one_line(results[name], where, what)
    assert results["dry_run"].returncode == 0, results["dry_run"].stderr
    fetched = {f: mirror.downloads(MODEL, f) for f in MODEL_FILES}
    assert fetched == {**dict.fromkeys(MODEL_FILES, 1), "model.safetensors": 0}
    assert mirror.downloads(REWARD_MODEL, "config.json") == 1
    assert mirror.downloads(REWARD_MODEL, "model.safetensors") == 0


@pytest.mark.slow
def test_offline_or_unreachable_without_the_cache_is_one_line_and_exit_2(hub_env, tmp_path):
    """HF_HUB_OFFLINE=1 and a cache that lacks the repository; the Hub unreachable (nothing
    listens at HF_ENDPOINT), in a real process: nothing else is printed (no "Retrying in 1s" lines
    of huggingface_hub's backoff either)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    results = _run_cases(OFFLINE, env | {"HF_HUB_OFFLINE": "1"}, tmp_path)
    for name, (_, where, what) in OFFLINE.items():
        _assert_one_line(results[name], where, what)
    assert "which HF_HUB_OFFLINE=1 keeps from being downloaded" in results["offline_model"].stderr
    workdir = tmp_path / "unreachable"
    workdir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_ds.check", TINY, f"run.output_dir={workdir}/out"]
        + [f"model.path={MODEL}"],
        cwd=workdir,
        env=env | {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    _assert_one_line(proc, "model.path", f"{MODEL} is not a local folder, the Hugging Face cache")
    assert "the Hugging Face Hub cannot be reached (ConnectError" in proc.stderr
