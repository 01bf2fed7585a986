"""A dataset on the Hugging Face Hub as rows (``data.train`` or ``eval.data`` given as a Hub id,
grpo_ds.run.hub), and the quiet way every dataset file is read through the ``datasets`` library.

A dataset's card (README.md) declares its configurations in its YAML header, each with its data
files per split (``configs: [{config_name, data_files: [{split, path}]}]``, the convention of the
Hub and of ``datasets``). ``hub_rows`` fetches the card, then only the files of the configuration
the recipe names (``data.train_config``; null: the only one, or the card's default), once per node;
a card that declares none stands for one configuration whose splits ``datasets`` tells from the
file names (train*, test*, ...), and every file of the repository is fetched. ``datasets`` then
reads the named split (``data.train_split``) from the snapshot folder, and its rows meet the checks
every dataset's rows meet (grpo_ds.run.prompts.prepare_prompts: the prompt column, its text, its
length).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_ds.config.recipe import DataConfig
from grpo_ds.errors import UserError, first_line, suggest
from grpo_ds.run.hub import HubRepo, hub_file, not_cached, offline, once_per_node, snapshot

CARD = "README.md"


def hub_rows(repo: HubRepo, data_cfg: DataConfig) -> list[dict]:
    """Every row of the split ``data_cfg.train_split`` of the configuration
    ``data_cfg.train_config`` of the Hub dataset ``repo``, as dicts in order."""
    config = data_cfg.train_config
    folder = once_per_node(repo, f"config {config}", lambda: _fetch(repo, config))
    chosen = _chosen_config(repo, _card_configs(folder / CARD), config)
    return _read_split(repo, folder, chosen, data_cfg.train_split)


def hub_source(repo: HubRepo, data_cfg: DataConfig) -> str:
    """How a run's data record (grpo_ds.run.prompts.data_identity) names a Hub dataset."""
    parts = [f"split {data_cfg.train_split}"]
    if data_cfg.train_config is not None:
        parts.insert(0, f"config {data_cfg.train_config}")
    if repo.revision is not None:
        parts.append(f"revision {repo.revision}")
    return f"{repo.repo_id} on the Hugging Face Hub ({', '.join(parts)})"


def _fetch(repo: HubRepo, config: str | None) -> Path:
    """The card, then the data files of the configuration, at the card's commit."""
    card = hub_file(repo, CARD)
    revision = card.parent.name if card is not None else None  # snapshots/<commit>/README.md
    configs = _card_configs(card)
    patterns = _config_files(configs, _chosen_config(repo, configs, config))
    return snapshot(repo, patterns, revision=revision)


def _card_configs(card: Path | None) -> list[dict]:
    """The configurations a dataset card declares ([] for none, or for no card)."""
    if card is None or not card.is_file():
        return []
    import yaml
    from huggingface_hub.repocard import metadata_load

    try:
        configs = (metadata_load(card) or {}).get("configs")
    except (OSError, ValueError, yaml.YAMLError):  # datasets says what is wrong when it reads it
        return []
    if not isinstance(configs, list):
        return []
    return [c for c in configs if isinstance(c, dict) and isinstance(c.get("config_name"), str)]


def _chosen_config(repo: HubRepo, configs: list[dict], config: str | None) -> str | None:
    """The configuration to read: the named one, else the only one or the card's default (None:
    the card declares none, and ``datasets`` takes its one configuration)."""
    key = repo.where + "_config"  # data.train -> data.train_config
    names = [c["config_name"] for c in configs]
    if config is None:
        defaults = [c["config_name"] for c in configs if c.get("default")]
        if len(names) > 1 and not defaults:
            raise UserError(
                key,
                f"the dataset {repo.repo_id} has {len(names)} configurations "
                f"({', '.join(names)}) and names none its default",
                f'name one, e.g. {key}="{names[0]}"',
            )
        return (defaults or names or [None])[0]
    if not names:
        raise UserError(
            key,
            f"{config!r}, but the dataset {repo.repo_id} declares no configurations",
            f"set {key} to null",
        )
    if config not in names:
        raise UserError(
            key,
            f"{config!r} is not a configuration of the dataset {repo.repo_id}",
            suggest(config, names, "its configurations"),
        )
    return config


def _config_files(configs: list[dict], chosen: str | None) -> list[str] | None:
    """The card and the file patterns of the ``chosen`` configuration's data files (None: every
    file of the repository)."""
    config = next((c for c in configs if c["config_name"] == chosen), None)
    if config is None:
        return None
    if isinstance(config.get("data_dir"), str):
        return [CARD, f"{config['data_dir'].strip('/')}/*"]
    patterns = _patterns(config.get("data_files"))
    return [CARD, *patterns] if patterns else None


def _patterns(files: Any) -> list[str]:
    """The path patterns of a configuration's ``data_files``: a pattern, a list of them, a list of
    {split, path} entries (each path one pattern or a list), or a mapping of split to patterns."""
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [p for value in files.values() for p in _patterns(value)]
    if isinstance(files, list):
        return [
            p
            for entry in files
            for p in _patterns(entry.get("path") if isinstance(entry, dict) else entry)
        ]
    return []


def _read_split(repo: HubRepo, folder: Path, config: str | None, split: str) -> list[dict]:
    """The split's rows, read by ``datasets`` from the snapshot folder."""
    import datasets

    where = f"{repo.where} {repo.repo_id}" + (f" (configuration {config})" if config else "")
    try:
        with read_quietly():
            splits = datasets.load_dataset(str(folder), name=config)
    except Exception as err:  # datasets and pyarrow raise many types; all mean "cannot read it"
        if offline():
            raise not_cached(repo, "in part") from None
        raise UserError(
            where,
            f"cannot read it ({first_line(root_cause(err))})",
            "check that its files are data files datasets reads (parquet, json, csv)",
        ) from None
    if split not in splits:
        raise UserError(
            repo.where + "_split",
            f"{split!r} is not a split of {repo.repo_id}"
            + (f" (configuration {config})" if config else ""),
            suggest(split, list(splits), "its splits"),
        )
    return splits[split].to_list()


@contextlib.contextmanager
def read_quietly() -> Iterator[None]:
    """``datasets`` without its log lines (it logs parse errors, which the caller reports once) and
    without its progress bars (one per small file is noise, and lands on stderr before an error
    line)."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def root_cause(err: BaseException) -> BaseException:
    """datasets wraps the parser's error (which says what is wrong) in a generic one; dig it out."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return err
