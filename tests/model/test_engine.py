"""The DeepSpeed engines' set-up quirks (grpo_ds.model.engine)."""

import pytest

from grpo_ds.model.engine import deepspeed_arch_list


def test_an_arch_specific_suffix_is_dropped_for_deepspeeds_op_builder(monkeypatch):
    """Found on an H200 image (TORCH_CUDA_ARCH_LIST=9.0a): DeepSpeed's JIT build of FusedAdam failed at the first
    engine. Its own parser is run here on the CPU, before and after."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", deepspeed_arch_list("8.0 9.0a"))
    builder.compute_capability_args()  # parses
    assert deepspeed_arch_list("8.0 9.0a") == "8.0;9.0"
    assert deepspeed_arch_list("7.5;8.6+PTX;10.0a") == "7.5;8.6+PTX;10.0"
    assert deepspeed_arch_list("9.0") == "9.0"
