"""The dtype names, in one place: what a recipe and an export accept, their widths, and DeepSpeed's
spellings.

A dtype is named by its torch name ("float32", "bfloat16", "float16") everywhere in grpo_ds; the
torch dtype is ``getattr(torch, name)`` (grpo_ds.model.loading.torch_dtype), so this module needs no
torch and the configuration stays torch-free. DeepSpeed enables a low precision by a config section
("bf16", "fp16") and spells a dtype in its own ways in ``data_types.param_dtype`` ("fp16", "half",
"bf16", ...): both are mapped here and nowhere else.
"""

from __future__ import annotations

# the recipe's and the export's choices, full precision first
DTYPES = ("float32", "bfloat16", "float16")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element
# the DeepSpeed config section that enables each
DEEPSPEED_SECTIONS = {"bfloat16": "bf16", "float16": "fp16"}
_DEEPSPEED_SPELLINGS = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def canonical(name: str) -> str | None:
    """The dtype name of a DeepSpeed spelling ("bf16" -> "bfloat16", "half" -> "float16", any case);
    None if it names no dtype grpo_ds trains in."""
    name = str(name).lower()
    return name if name in DTYPES else _DEEPSPEED_SPELLINGS.get(name)
