"""Prompts: load the training rows, turn them into token ids, and sample them deterministically.

``load_rows`` reads ``data.train`` (a builtin dataset, a .jsonl/.json/.parquet file, a saved HF
dataset folder, or a dataset on the Hugging Face Hub named by its id: grpo_ds.run.hub_data) into
plain dicts; ``prepare_prompts`` checks every row (prompt present, a non-empty string, at most
``data.max_prompt_tokens`` tokens), applies the chat template if asked, and either stops at the
first bad row or skips and counts the bad ones; ``PromptSampler`` walks seeded
permutations epoch after epoch and can resume exactly from its ``state_dict``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from grpo_ds.config.parse import printable
from grpo_ds.config.recipe import DataConfig
from grpo_ds.errors import UserError, first_line
from grpo_ds.run.hub import HubRepo, hub_repo
from grpo_ds.run.hub_data import hub_rows, hub_source, read_quietly, root_cause

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# ------------------------------------------------------------------------------------------ builtin


def arith_rows() -> list[dict]:
    """25 one-digit sums "a+b=" for a, b in 0..4: small enough for the tiny model to learn in a few
    steps."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]


BUILTIN_DATASETS: dict[str, Callable[[], list[dict]]] = {"arith": arith_rows}

_SUFFIXES = (".jsonl", ".json", ".parquet")
_SKIP_FIX = 'data.on_bad_row="skip"'

# ------------------------------------------------------------------------------------------ loading


def load_rows(data_cfg: DataConfig, source_dir: str = ".") -> list[dict]:
    """All rows of data.train as dicts, in file order. Relative paths are tried in the working
    directory first, then next to the recipe file (``source_dir``); a name that is neither, and
    reads as "owner/name", is a Hub dataset's id."""
    spec = data_cfg.train
    repo = _hub_dataset(data_cfg, source_dir)
    if repo is not None:
        return hub_rows(repo, data_cfg)
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_DATASETS:
            close = difflib.get_close_matches(name, BUILTIN_DATASETS, n=1, cutoff=0.5)
            hint = (
                f'did you mean "builtin:{close[0]}"?'
                if close
                else "builtin datasets: " + ", ".join(f'"builtin:{n}"' for n in BUILTIN_DATASETS)
            )
            raise UserError("data.train", f"unknown builtin dataset {name!r}", hint)
        return BUILTIN_DATASETS[name]()
    path = _resolve(spec, source_dir)
    if path.is_dir():
        return _load_saved_dataset(path)
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise UserError(
            "data.train",
            f"{printable(spec)}: unsupported file type {suffix or '(no extension)'!r}",
            "give a .jsonl, .json or .parquet file, or a folder saved with Dataset.save_to_disk",
        )
    empty = {
        ".jsonl": lambda: not _check_jsonl(path),
        ".json": lambda: _blank(path),
        ".parquet": lambda: _parquet_rows(path) == 0,
    }[suffix]
    if empty():
        raise UserError(
            f"data.train {printable(spec)}",
            "has no rows (the file is empty)",
            "give a dataset with at least one prompt row",
        )
    return _load_file(path, "parquet" if suffix == ".parquet" else "json")


def _hub_dataset(data_cfg: DataConfig, source_dir: str) -> HubRepo | None:
    """data.train as a Hub dataset, or None when it names a builtin or a local path (which takes no
    configuration or revision: refused)."""
    repo = hub_repo(
        "data.train",
        data_cfg.train,
        "dataset",
        data_cfg.train_revision,
        "data.train_revision",
        source_dir,
    )
    if repo is None and data_cfg.train_config is not None:
        raise UserError(
            "data.train_config",
            f"{data_cfg.train_config!r} picks a configuration of a Hugging Face Hub dataset, but "
            f"data.train {printable(data_cfg.train)} is not a Hub id",
            "set data.train_config to null for a local dataset or a builtin",
        )
    return repo


def _resolve(spec: str, source_dir: str) -> Path:
    path = Path(spec).expanduser()
    candidates = [path] if path.is_absolute() else [path, Path(source_dir) / path]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    looked = " or ".join(printable(str(c)) for c in dict.fromkeys(candidates))
    raise UserError(
        "data.train",
        f"{printable(spec)} not found (looked for {looked})",
        "give a .jsonl/.json/.parquet file or a saved HF dataset folder (relative paths are taken "
        "from the working directory, then the recipe's folder), a Hub dataset id owner/name, or "
        '"builtin:arith"',
    )


def _check_jsonl(path: Path) -> int:
    """Find the first malformed line ourselves, so the message can name its line number; return the
    row count."""
    rows = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{path}:{lineno}",
                    f"invalid JSON ({err.msg} at column {err.pos + 1})",
                    "each line of a .jsonl file must be one JSON object",
                ) from None
            if not isinstance(value, dict):
                raise UserError(
                    f"{path}:{lineno}",
                    f"expected a JSON object, got {type(value).__name__}",
                    "each line of a .jsonl file must be one "
                    'object, e.g. {"prompt": "...", "answer": "4"}',
                )
            rows += 1
    return rows


def _parquet_rows(path: Path) -> int | None:
    """A parquet file's row count from its footer (None when unreadable: loading it then says
    why)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # pyarrow raises several types for a damaged file; _load_file then reports it
        return None


def _blank(path: Path) -> bool:
    """A .json file holding nothing but whitespace, or an empty list or object (datasets fails on it
    obscurely)."""
    with path.open("rb") as f:
        head = f.read(1 << 16)
    return len(head) < 1 << 16 and "".join(head.decode("utf-8", errors="replace").split()) in (
        "",
        "[]",
        "{}",
    )


def _load_file(path: Path, builder: str) -> list[dict]:
    import datasets  # heavy import, only when a file is actually read

    try:
        with read_quietly():
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
    # datasets/pyarrow raise many types for a malformed file; all mean "fix the file"
    except Exception as err:
        raise UserError(
            f"{path}",
            f"cannot read it as {builder} ({first_line(root_cause(err))})",
            "check that the file is valid and every row has the same column types",
        ) from None
    return dataset.to_list()


def _load_saved_dataset(path: Path) -> list[dict]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    # datasets indexes the first of its data files, and a dataset saved with no rows has none
    except IndexError:
        raise UserError(
            f"data.train {path}",
            "has no rows (a saved dataset without data files)",
            "give a dataset with at least one prompt row",
        ) from None
    except (FileNotFoundError, ValueError, OSError) as err:
        raise UserError(
            "data.train",
            f"{path} is a folder but not a saved HF dataset ({first_line(err)})",
            "give a folder written by Dataset.save_to_disk, or a .jsonl/.json/.parquet file",
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise UserError(
                "data.train",
                f"{path} is a DatasetDict without a 'train' split (splits: {', '.join(dataset)})",
                "save the training split under the name 'train'",
            )
        dataset = dataset["train"]
    return dataset.to_list()


# ------------------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class PromptRow:
    """One usable prompt. ``index`` is its 0-based row number in the source (messages print it
    1-based)."""

    index: int
    prompt_text: str  # after the chat template, if data.chat_template
    prompt_ids: list[int]
    columns: dict  # every column of the row, the answer included; reward functions read them


class _BadRow(NamedTuple):
    """Why a row is not used: its ``kind`` (counted when every row is bad) and its message."""

    kind: str
    what: str
    fix: str


def prepare_prompts(
    rows: list[dict], data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, where: str
) -> tuple[list[PromptRow], int]:
    """Check and tokenize every row; return (good rows, number of bad rows skipped).

    With data.on_bad_row="error" the first bad row raises UserError(f"{where} row N", ...); with
    "skip" bad rows are dropped and counted. No usable row at all is always an error.
    """
    if not rows:
        raise UserError(where, "has no rows", "give a dataset with at least one prompt")
    key = data_cfg.prompt_key
    problems: dict[int, _BadRow] = {}  # row index -> why it is bad
    texts: dict[int, str] = {}
    for i, row in enumerate(rows):
        value = row.get(key) if isinstance(row, dict) else None
        if (problem := _text_problem(row, value, key)) is not None:
            problems[i] = problem
        else:
            texts[i] = _apply_template(value, tokenizer) if data_cfg.chat_template else value
    encoded = (
        tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"] if texts else []
    )
    ids = dict(zip(texts, encoded, strict=True))
    problems |= _too_long(ids, data_cfg.max_prompt_tokens)
    if problems and data_cfg.on_bad_row == "error":
        first = min(problems)
        raise UserError(f"{where} row {first + 1}", problems[first].what, problems[first].fix)
    good = [
        PromptRow(index=i, prompt_text=texts[i], prompt_ids=list(ids[i]), columns=dict(rows[i]))
        for i in sorted(ids)
        if i not in problems
    ]
    if not good:
        kinds = Counter(bad.kind for bad in problems.values())
        detail = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
        raise UserError(
            where,
            f"all {len(rows)} rows are bad ({detail})",
            f"check data.prompt_key ({key!r}) and data.max_prompt_tokens",
        )
    return good, len(problems)


def _text_problem(row, value, key: str) -> _BadRow | None:
    """What is wrong with a row's prompt ``value`` (read at ``key``) as text; None: nothing."""
    if value is None:
        present = (
            ", ".join(k for k, v in row.items() if v is not None) if isinstance(row, dict) else ""
        )
        return _BadRow(
            "missing",
            f"no {key!r} key (keys: {present or 'none'})",
            f"set data.prompt_key to one of them, or {_SKIP_FIX}",
        )
    if not isinstance(value, str):
        return _BadRow(
            "not text",
            f"{key!r} is {type(value).__name__} {json.dumps(value, default=str)[:60]}, "
            "not a string",
            f"point data.prompt_key at a text column, or {_SKIP_FIX}",
        )
    if not value.strip():
        return _BadRow("empty", f"{key!r} is empty", f"remove the row, or {_SKIP_FIX}")
    return None


def _too_long(ids: dict[int, list[int]], max_prompt_tokens: int) -> dict[int, _BadRow]:
    """The rows whose tokens are more than data.max_prompt_tokens, in row order."""
    return {
        i: _BadRow(
            "too long",
            f"prompt is {len(tokens)} tokens, more than data.max_prompt_tokens={max_prompt_tokens}",
            f"raise data.max_prompt_tokens, or {_SKIP_FIX}",
        )
        for i, tokens in ids.items()
        if len(tokens) > max_prompt_tokens
    }


def _apply_template(prompt: str, tokenizer: PreTrainedTokenizerBase) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "data.chat_template",
            "the tokenizer has no chat template",
            "set data.chat_template=false, or use a model whose tokenizer defines one",
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


# ----------------------------------------------------------------------------------------- sampling


def data_source(data_cfg: DataConfig, source_dir: str) -> str:
    """What data.train names, for a run's data record: a builtin name, a Hub dataset's id with its
    configuration, split and revision, or the resolved path."""
    spec = data_cfg.train
    repo = _hub_dataset(data_cfg, source_dir)
    if repo is not None:
        return hub_source(repo, data_cfg)
    return spec if spec.startswith("builtin:") else str(_resolve(spec, source_dir).resolve())


def data_identity(source: str, prompts: list[PromptRow]) -> dict:
    """What a run trains on, recorded in its run folder (data.json) and checkpoints: the source
    (``data_source``), the number of prompts kept, and a fingerprint of their text and columns in
    order."""
    digest = hashlib.sha256()
    for row in prompts:
        digest.update(
            json.dumps([row.prompt_text, row.columns], sort_keys=True, default=str).encode()
        )
        digest.update(b"\n")
    return {"source": source, "prompts": len(prompts), "sha256": digest.hexdigest()}


def data_changes(before: dict, now: dict) -> str | None:
    """How the data of a run changed between ``before`` and ``now`` (data_identity), in words; None
    if it did not."""
    what = []
    if before.get("source") != now["source"]:
        what.append(f"its source was {before.get('source')}, now {now['source']}")
    if before.get("prompts") != now["prompts"]:
        what.append(f"it held {before.get('prompts')} prompts, now {now['prompts']}")
    elif before.get("sha256") != now["sha256"]:
        what.append(
            f"its {now['prompts']} prompts differ (fingerprint {str(before.get('sha256'))[:12]}, "
            f"now {now['sha256'][:12]})"
        )
    return "; ".join(what) or None


class PromptSampler:
    """Deterministic, resumable order of prompt indices.

    Epoch e visits every index once, in the order ``numpy.random.default_rng(seed + e).permutation``
    (or 0..N-1 without shuffling); ``next_indices`` crosses epoch boundaries seamlessly. Only
    (epoch, position) is state, so a resumed run draws exactly the prompts the uninterrupted run
    would have drawn.
    """

    def __init__(self, num_prompts: int, seed: int, shuffle: bool) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = self.num_prompts
            self._order = (
                np.random.default_rng(self.seed + self.epoch).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_epoch = self.epoch
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` prompt indices (n may exceed the number of prompts: it wraps through
        epochs)."""
        out: list[int] = []
        while len(out) < n:
            order = self._epoch_order()
            take = min(n - len(out), self.num_prompts - self.position)
            out.extend(int(i) for i in order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        """Where the sampler stands: enough to resume the same sequence."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict, data_changed: bool = False) -> None:
        """Continue from a ``state_dict()`` taken from a sampler with the same num_prompts, seed and
        shuffle. With ``data_changed`` (the prompts changed since, and the run goes on:
        data.on_change "continue"), the position in the old order means nothing: a new pass over the
        changed data begins, as the next epoch."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if data_changed:
            epoch, position = epoch + (position > 0), 0
        if epoch < 0 or not 0 <= position < self.num_prompts:
            raise ValueError(f"sampler state {state} does not fit {self.num_prompts} prompts")
        self.epoch, self.position = epoch, position
