"""Every ``reward.models`` entry checked before any model loads: its folder, its head, its weight
files, its tokenizer and its length setting, each problem one ``UserError`` line (exit 2 through the
command lines). Only config.json, the weight files' headers (grpo_ds.model.weight_files) and the
tokenizer files are read (the tokenizer is built from its local files, nothing is downloaded); no
weight is loaded.

grpo_ds.run.preflight.prepare_inputs calls ``check_reward_models`` with the recipe's parsed specs
(grpo_ds.config.reward_specs), so ``python -m grpo_ds.train`` and the dry run ``python -m
grpo_ds.check`` refuse the same folders the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from grpo_ds.config.parse import printable
from grpo_ds.config.recipe import ModelConfig
from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.errors import UserError, first_line
from grpo_ds.model.loading import TOKENIZER_FILES, context_length, load_saved_tokenizer
from grpo_ds.model.weight_files import check_model_weights

# the architectures' suffix of a model with a classification (score) head
_HEAD = "ForSequenceClassification"
_SAVE = (
    "save it with AutoModelForSequenceClassification "
    "(num_labels=1) and its tokenizer's save_pretrained"
)


def check_reward_models(
    specs: Sequence[RewardModelSpec], unfetched_weights: Collection[int] = ()
) -> None:
    """Each reward model's folder checked (``check_reward_model``), in the recipe's order; the
    weights of the models at ``unfetched_weights`` (the dry run's Hub models, fetched without them)
    are not."""
    for i, spec in enumerate(specs):
        check_reward_model(f"reward.models[{i}]", spec, weights=i not in unfetched_weights)


def check_reward_model(where: str, spec: RewardModelSpec, weights: bool = True) -> None:
    """Raise UserError, at ``where``.key, for the first problem: a missing folder or one without
    config.json; not a sequence classifier, or not one label; weight files missing, cut short or of
    another format (unless not ``weights``); a max_length past the model's context length (or none
    to be found); no tokenizer files, a tokenizer that cannot be built, has no token to pad with
    (pad, eos or unk), has more tokens than the model's vocabulary, or no chat template where
    chat_template is true."""
    folder = _folder(f"{where}.path", spec.path)
    config = _config(f"{where}.path", folder)
    if weights:
        check_model_weights(f"{where}.path", folder)
    _check_length(f"{where}.max_length", spec, folder)
    tokenizer = _tokenizer(f"{where}.path", folder)
    name = printable(spec.path)
    # scoring pads the rows of a padded micro-batch and reads each sequence at its last token, so
    # any token pads (the scorer takes the eos or unk token where there is no pad token)
    if tokenizer.pad_token is None and tokenizer.eos_token is None and tokenizer.unk_token is None:
        raise UserError(
            f"{where}.path",
            f"the tokenizer in {name} has no pad, eos or unk token to pad a batch with",
            f'set "pad_token" in {name}/tokenizer_config.json',
        )
    if getattr(config, "vocab_size", None) and len(tokenizer) > config.vocab_size:
        raise UserError(
            f"{where}.path",
            f"the tokenizer in {name} has {len(tokenizer)} tokens, more than the model's "
            f"vocabulary of {config.vocab_size} (config.json vocab_size)",
            "save the reward model's own tokenizer into its folder",
        )
    if spec.chat_template and not tokenizer.chat_template:
        raise UserError(
            f"{where}.chat_template",
            f"is true but the tokenizer in {name} has no chat template",
            "set chat_template false to score the plain prompt + completion text, or add a "
            '"chat_template" to its tokenizer_config.json',
        )


def _folder(where: str, path: str) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise UserError(
            where,
            f"{printable(path)} does not exist",
            "give a local folder holding a sequence-classification model and its tokenizer, or "
            "the Hugging Face Hub id of one (owner/name)",
        )
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise UserError(
            where,
            f"{printable(path)} is not a Hugging Face model folder (no config.json in it)",
            f"give the folder that holds config.json, the weights and the tokenizer; {_SAVE}",
        )
    return folder


def _config(where: str, folder: Path):
    """config.json as transformers reads it (its num_labels rule: id2label's size, else 2), after
    checking the head."""
    from transformers import AutoConfig

    name = printable(str(folder))
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            where,
            f"cannot read {name}/config.json ({first_line(err)})",
            "give a folder saved by transformers' save_pretrained",
        ) from None
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith(_HEAD) for a in architectures):
        held = (
            f"a {', '.join(architectures)}"
            if architectures
            else "a model whose config.json names no architectures"
        )
        raise UserError(
            where,
            f"{name} holds {held}, not a sequence classifier (no *{_HEAD} in config.json "
            "architectures)",
            f"a reward model has a score head with one label; {_SAVE}",
        )
    if config.num_labels != 1:
        raise UserError(
            where,
            f"{name}'s classification head has {config.num_labels} labels (config.json "
            "id2label); a reward model gives one score",
            f"use a model trained with num_labels=1; {_SAVE}",
        )
    return config


def _check_length(where: str, spec: RewardModelSpec, folder: Path) -> None:
    """max_length within the model's context length, read as the policy's is
    (grpo_ds.model.loading.context_length: the smallest length key of config.json, RoPE scaling
    included)."""
    found = context_length(ModelConfig(path=str(folder)))
    if found is None:
        if spec.max_length is None:
            raise UserError(
                where,
                f"is null (the model's context length), but {printable(spec.path)}/config.json "
                "names none (max_position_embeddings)",
                "set max_length to the tokens the model takes",
            )
        return
    limit, source = found
    if spec.max_length is not None and spec.max_length > limit:
        raise UserError(
            where,
            f"{spec.max_length} is more than the model's context length {limit} ({source})",
            f"use at most {limit}, or null (= {limit})",
        )


def _tokenizer(where: str, folder: Path):
    """The tokenizer as the scorer loads it (grpo_ds.model.loading.load_saved_tokenizer: the class
    the folder saved, whatever its model type)."""
    name = printable(str(folder))
    if not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise UserError(
            where,
            f"{name} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})",
            "save the reward model's tokenizer into its folder (tokenizer.save_pretrained(folder))",
        )
    try:
        return load_saved_tokenizer(folder)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            where,
            f"cannot load a tokenizer from {name} ({first_line(err)})",
            "save the reward model's tokenizer into its folder (tokenizer.save_pretrained(folder))",
        ) from None
