"""The DeepSpeed engines' set-up (grpo_ds.model.engine): its quirks, and the one-rank fp32 master
that is the weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.model.engine import (
    create_train_engine,
    deepspeed_arch_list,
    share_fp32_master,
    shared_master_note,
)
from grpo_ds.model.tiny import build_tiny_model


def test_an_arch_specific_suffix_is_dropped_for_deepspeeds_op_builder(monkeypatch):
    """Found on an H200 image (TORCH_CUDA_ARCH_LIST=9.0a): DeepSpeed's JIT build of FusedAdam failed
    at the first engine. Its own parser is run here on the CPU, before and after."""
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


def _stage1_engine(share: bool, dtype: torch.dtype = torch.float32):
    """A one-rank engine as grpo_ds builds it from ds_configs/zero3.json (stage 1), over a tiny
    model."""
    init_distributed()
    recipe = load_recipe(
        {
            "model": {"dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]},
            "train": {"lr": 1e-2},
        }
    )
    model = build_tiny_model(64, hidden_size=32, num_layers=2, num_heads=4, seed=0).to(dtype)
    engine = create_train_engine(model, resolve_deepspeed_config(recipe, 1, "cpu"))
    freed = share_fp32_master(engine) if share else 0
    return engine, freed


def _train(engine, steps: int, first: int = 0) -> list[float]:
    norms = []
    for step in range(first, first + steps):
        tokens = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def _same_tensor_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_one_rank_float32_master_is_the_module_weights_and_trains_bit_identically(tmp_path):
    shared, freed = _stage1_engine(share=True)
    plain, _ = _stage1_engine(share=False)
    assert shared.zero_optimization_stage() == 1
    trained = sum(p.numel() for p in shared.module.parameters())
    flat = shared.optimizer.parallel_partitioned_bit16_groups[0][0]
    master = shared.optimizer.single_partition_of_fp32_groups[0]
    # the whole clone (plus DeepSpeed's alignment padding)
    assert freed == master.numel() * 4 >= trained * 4
    assert _same_tensor_memory(master, flat)
    # views of the one flat buffer
    assert all(_same_tensor_memory(p, flat) for p in shared.module.parameters())
    # DeepSpeed's per-parameter views of the master (universal checkpoints load through them) follow
    # it: a view left on the old copy kept it alive and sent a universal checkpoint's weights into
    # it (a resume lost them)
    assert all(
        _same_tensor_memory(p._hp_mapping.hp_fragment, flat) for p in shared.module.parameters()
    )
    assert not _same_tensor_memory(
        plain.optimizer.single_partition_of_fp32_groups[0],
        plain.optimizer.parallel_partitioned_bit16_groups[0][0],
    )

    assert _train(shared, 3) == _train(plain, 3)  # the same grad norms, step by step
    for (name, a), b in zip(
        shared.module.named_parameters(), plain.module.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not torch.equal(
        shared.module.lm_head.weight, build_tiny_model(64, 32, 2, 4, seed=0).lm_head.weight
    )
    assert share_fp32_master(shared) == 0  # already shared: nothing more to free

    # a checkpoint in DeepSpeed's own format, loaded into a fresh shared engine, continues exactly
    shared.save_checkpoint(str(tmp_path), tag="t")
    plain.save_checkpoint(str(tmp_path / "plain"), tag="t")
    resumed, _ = _stage1_engine(share=True)
    resumed.load_checkpoint(
        str(tmp_path), tag="t", load_optimizer_states=True, load_lr_scheduler_states=True
    )
    share_fp32_master(resumed)  # what Policy.load_state does after every load
    assert _same_tensor_memory(
        resumed.optimizer.single_partition_of_fp32_groups[0],
        resumed.optimizer.parallel_partitioned_bit16_groups[0][0],
    )
    saved = torch.load(next((tmp_path / "t").glob("*optim_states.pt")), weights_only=False)
    saved_plain = torch.load(
        next((tmp_path / "plain" / "t").glob("*optim_states.pt")), weights_only=False
    )
    master_key = "single_partition_of_fp32_groups"
    assert torch.equal(
        saved["optimizer_state_dict"][master_key][0],
        saved_plain["optimizer_state_dict"][master_key][0],
    )
    assert _train(resumed, 2, first=3) == _train(plain, 2, first=3)
    for a, b in zip(resumed.module.parameters(), plain.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_master_weights_of_bfloat16_weights_stay_a_float32_copy():
    engine, freed = _stage1_engine(share=True, dtype=torch.bfloat16)
    assert freed == 0
    master = engine.optimizer.single_partition_of_fp32_groups[0]
    assert master.dtype == torch.float32
    assert not _same_tensor_memory(master, engine.optimizer.parallel_partitioned_bit16_groups[0][0])


def test_the_note_says_what_was_saved():
    assert shared_master_note(171_328_512).endswith("(no second copy: 163.4 MiB saved)")
    assert "1.50 GiB saved" in shared_master_note(3 * 2**29)


# In a fresh interpreter (this one may have imported torch._inductor already): the engine's Muon
# import pulls in no TorchDynamo backend, leaves TORCHDYNAMO_DISABLE as it was, and a config that
# names Muon is left to DeepSpeed.
MUON_PROBE = """
import json, os, sys
import deepspeed
from grpo_ds.model.engine import _MUON, _import_muon_uncompiled
_import_muon_uncompiled({"optimizer": {"type": "Muon"}})
named = _MUON in sys.modules
_import_muon_uncompiled({"optimizer": {"type": "AdamW"}})
print(json.dumps({"named": named, "imported": _MUON in sys.modules, "env": os.environ.get("TORCHDYNAMO_DISABLE"),
                  "inductor": "torch._inductor.compile_fx" in sys.modules}))
"""  # noqa: E501


def test_the_muon_module_deepspeed_imports_costs_no_compiler_import():
    proc = subprocess.run(
        [sys.executable, "-c", MUON_PROBE],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "named": False,
        "imported": True,
        "env": None,
        "inductor": False,
    }
