"""Weight files checked from their headers before anything loads, so that a file cut short by a copy
that did not finish, or a file of another format, is one line naming it instead of a library's
traceback minutes into a run. It checks a model folder's weights (the policy's, which the
reference model shares, and each reward model's) and a checkpoint's PyTorch files
(grpo_ds.run.checkpoint.verify). A few kilobytes are read per file; no tensor is read.

Where each format says it is complete:

    safetensors   8 bytes (little-endian u64 N), an N-byte JSON header {name: {"dtype", "shape",
                  "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data. The tensors
                  tile the data section, so the file is complete when its size is 8 + N + the
                  largest end offset; the safetensors library refuses a file that is any shorter
                  or longer ("incomplete metadata, file not fully covered").
    PyTorch       torch.save's zip archive (since torch 1.6): its central directory is the last part
                  of the file, so a file cut short has none. A file that is not a zip archive is
                  read by torch.load as the legacy pickle format, which has no such check.
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

from safetensors import SafetensorError

from grpo_ds.config.parse import printable
from grpo_ds.errors import UserError, first_line

# What transformers loads from a model folder, in its order of preference: one file, or an index
# whose "weight_map" names the shards.
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH, PYTORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH, PYTORCH_INDEX)
# the safetensors library's limit on the header (MAX_HEADER_SIZE): a larger N is not a header
_MAX_HEADER = 100_000_000
# torch.save's zip archives start with a local file header; legacy files with a pickle (protocol 2+)
_ZIP_MAGIC, _PICKLE_MAGIC = b"PK\x03\x04", b"\x80"
# What a load raises on a damaged or unreadable file (transformers passes safetensors' and pickle's
# errors on, and wraps some in OSError); torch.load's zip reader raises a RuntimeError
# (is_damaged_file_error).
FILE_ERRORS = (OSError, SafetensorError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile)
FIX = (
    "copy the folder again (a copy that did not finish leaves files cut short), or save the model "
    "again with save_pretrained"
)


def check_model_weights(where: str, folder: Path) -> None:
    """Raise UserError, at ``where``, unless the weights transformers would load from ``folder``
    are there and complete."""
    problem = model_weights_problem(folder)
    if problem:
        raise UserError(where, problem, FIX)


def model_weights_problem(folder: Path) -> str | None:
    """What is wrong with a model folder's weights, naming the file: none of WEIGHT_NAMES, an index
    that cannot be read or names a missing shard, a file cut short or of another format; None when
    they are complete."""
    name = printable(str(folder))
    present = next((n for n in WEIGHT_NAMES if (folder / n).is_file()), None)
    if present is None:
        return f"{name} holds no weights (none of {', '.join(WEIGHT_NAMES)})"
    if present in (SAFETENSORS, PYTORCH):
        files = [folder / present]
    else:
        shards = _index_shards(folder / present)
        if isinstance(shards, str):
            return f"{name}/{present} {shards}"
        files = [folder / shard for shard in shards]
    for path in files:
        if not path.is_file():
            return f"{printable(str(path))} is missing (named in {name}/{present})"
        if problem := file_problem(path):
            return f"{printable(str(path))} {problem}"
    return None


def _index_shards(index: Path) -> list[str] | str:
    """The shard files a weights index names (its "weight_map" values, each once, in order), or
    what is wrong with the index."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        return f"cannot be read as a weights index ({first_line(err)})"
    if not isinstance(weight_map, dict) or not weight_map:
        return 'is not a weights index (no "weight_map" object naming the shards)'
    shards = list(dict.fromkeys(weight_map.values()))
    if not all(isinstance(s, str) and s and not Path(s).is_absolute() for s in shards):
        return 'is not a weights index (its "weight_map" names a shard that is not a file name)'
    return shards


def file_problem(path: Path) -> str | None:
    """What is wrong with one weights file, by its format (``.safetensors``, else PyTorch's), as a
    phrase that follows its name ("is cut short: ..."); None when it is complete."""
    try:
        return (
            safetensors_problem(path) if path.suffix == ".safetensors" else torch_file_problem(path)
        )
    except OSError as err:
        return f"cannot be read ({err.strerror or first_line(err)})"


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file's 8-byte length, JSON header and size against its tensors' offsets."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is cut short or not a safetensors file ({size} bytes, no 8-byte header length)"
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            return (
                "is not a safetensors file (its first 8 bytes give a header length of "
                f"{length:,} bytes)"
            )
        if 8 + length > size:
            return f"is cut short: its header alone is {8 + length:,} bytes, the file {size:,}"
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"is not a safetensors file (its header is not JSON: {first_line(err)})"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    spans = []
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            return f"has a damaged header (tensor {tensor!r} has no valid data_offsets)"
        spans.append(tuple(offsets))
    spans.sort()
    end = 0
    for begin, stop in spans:  # the tensors tile the data section, without holes or overlaps
        if begin != end:
            return f"has a damaged header (its tensors' data_offsets leave a gap at byte {end:,})"
        end = stop
    expected = 8 + length + end
    if size < expected:
        return (
            f"is cut short: {size:,} of its {expected:,} bytes are there "
            f"({100 * size // expected}%; incomplete metadata, file not fully covered)"
        )
    if size > expected:
        return f"is {size - expected:,} bytes longer than its header describes ({expected:,})"
    return None


def torch_file_problem(path: Path) -> str | None:
    """A torch.save file: a zip archive whose central directory (written last) can be read and
    that holds a pickle; a legacy (pre-zip) file is not checked."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic.startswith(_PICKLE_MAGIC):
        return None
    if magic != _ZIP_MAGIC:
        return "is not a PyTorch file (neither a zip archive nor a pickle)"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        return (
            "is cut short or damaged: a zip archive whose central directory (written last) is gone"
        )
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return "is a zip archive but not a PyTorch file (no data.pkl in it)"
    return None


def is_damaged_file_error(err: BaseException) -> bool:
    """Whether a load failed on a damaged or unreadable file rather than a bug: FILE_ERRORS, or
    torch.load's zip reader (a RuntimeError "PytorchStreamReader failed reading zip archive")."""
    if isinstance(err, RuntimeError):
        return "PytorchStreamReader" in str(err)
    return isinstance(err, FILE_ERRORS)
