"""Ulysses sequence parallelism (DeepSpeed's ``UlyssesSPAttentionHF``): every sequence split along
its length.

With train.sequence_parallel_size sp > 1, the sp consecutive ranks of a group hold the same samples
(like a tensor-parallel group) and each feeds the model its slice of every micro-batch's positions:
columns [r T/sp, (r+1) T/sp) of the rows (T padded to a multiple of sp). DeepSpeed's attention
wrapper exchanges heads for sequence slices with two all-to-alls per layer, so attention sees whole
sequences, and everything else (the linear layers, the fused lm_head, the loss) works on the rank's
own positions (grpo_ds.step.micro_batch.shard_sequences cuts them). Each rank scores the response
tokens whose predicting position is in its slice, with targets taken from the unsplit sequence, and
its loss is its partial sum of the micro-batch's: the partial sums of the sp ranks add up to the
micro-batch's loss (grpo_ds.step.loss).

What DeepSpeed's wrapper needs, and what grpo_ds does about it:
- it replaces transformers' attention function for the model's implementation process-wide (sdpa or
  flash attention; eager is refused): the rollout engine's unsharded copy must not use that
  implementation (``keep_out``), and ``restore`` puts the original back when the run ends;
- every forward has the same number of rows (it checks the shapes it was registered with):
  micro-batches are padded with empty rows to ``rows`` (the larger of the update and log-prob micro
  sizes; dynamic batching is refused);
- it drops attention masks (sdpa then attends causally over the gathered sequence): sequences are
  right-padded, so a real token never sees a pad, and packed rows (which need the mask) are not used
  (the padded layout instead);
- position_ids in every forward;
- gradients: ZeRO-3 averages them over the sp x dp ranks, so a rank's partial loss is scaled by dp x
  sp (grpo_ds.step.loss.backward); ZeRO stages 0-2 reduce over sp differently and are refused
  (grpo_ds.config.deepspeed).
"""

from __future__ import annotations

import torch

# attention implementation -> transformers' function before the wrapper
_SAVED: dict[str, object] = {}
# "size" -> the sequence-parallel size DeepSpeed's groups were built for
_REGISTERED: dict[str, int] = {}


def register(model: torch.nn.Module, sp_size: int, rows: int):
    """Swap the model's attention for DeepSpeed's Ulysses wrapper; return DeepSpeed's groups (mpu)
    for deepspeed.initialize. Call on every rank before the engines are built."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    _SAVED.setdefault(impl, ALL_ATTENTION_FUNCTIONS[impl])
    # a second run in this process (a notebook): DeepSpeed 0.19.8 refuses to build the groups
    if _REGISTERED:
        groups._release_sequence_parallel_groups()  # again and has no public way to drop them
    _REGISTERED["size"] = sp_size
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=impl,
        sequence_parallel_size=sp_size,
        micro_batch_size=rows,
        seq_length_is_variable=True,
    )


def restore() -> None:
    """Put transformers' attention functions back (a later run in this process may not use sequence
    parallelism)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for impl, fn in _SAVED.items():
        ALL_ATTENTION_FUNCTIONS[impl] = fn
    _SAVED.clear()


def keep_out(model: torch.nn.Module) -> None:
    """Give an unsharded model (the rollout engine's copy) another attention implementation than the
    one the wrapper replaces: sdpa -> eager, flash attention -> sdpa."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa" if impl.startswith("flash_attention") else "eager")
