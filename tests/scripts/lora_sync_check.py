"""A LoRA weight sync on several ranks (launched by `deepspeed`; read by tests/model/test_lora.py).

    deepspeed --num_gpus 2 tests/scripts/lora_sync_check.py OUT.json

A tiny Llama gets LoRA adapters on every linear layer (random non-zero B, so the merge matters) and
is partitioned by ZeRO-3. ``grpo_ds.model.lora.merged_weights`` is read as a rollout engine would,
with the collectives and the storage of every gathered buffer, handed-out tensor and adapter copy
watched (tests/scripts/weight_sync_check.py's Watch, plus the clones the merge makes of each layer's
A and B), against peft's own merge_and_unload of an unpartitioned copy. Rank 0 writes one JSON
record per bucket size.
"""

import copy
import sys
from pathlib import Path

# this checkout's grpo_ds, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import end_launched_rank, init_distributed
from grpo_ds.model import lora
from grpo_ds.model.engine import create_train_engine
from tests.scripts.weight_sync_check import Watch, consume, write_every_rank


def main(out_path: str) -> None:
    dist = init_distributed()
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    recipe = load_recipe(
        {
            "model": {"lora_rank": 4, "lora_alpha": 8},
            "deepspeed": {
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}
            },
        }
    )
    model = lora.apply_lora(LlamaForCausalLM(config), recipe.model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            # peft starts B at zero: the merge would change nothing
            torch.nn.init.normal_(param, std=0.5)
    merged = copy.deepcopy(model).merge_and_unload()
    reference = {n: p.detach().clone() for n, p in merged.named_parameters()}
    engine = create_train_engine(model, resolve_deepspeed_config(recipe, dist.world_size, "cpu"))
    params = list(engine.module.parameters())
    # partitioned, nothing held outside a gather
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
    padded = {
        id(p): p.ds_tensor.ds_numel * dist.world_size * p.ds_tensor.element_size() for p in params
    }
    adapted = [(n, p) for n, p in engine.module.named_parameters() if ".base_layer.weight" in n]
    adapters = [p for n, p in engine.module.named_parameters() if "lora_" in n]
    total = sum(padded[id(p)] for _, p in adapted) + sum(padded[id(p)] for p in adapters)
    largest = max(padded[id(p)] for _, p in adapted)
    runs = {
        "adapted_layers": len(adapted),
        "all_parameters": len(params),
        "total_bytes": total,
        "largest_padded_bytes": largest,
        "adapter_bytes": sum(p.ds_numel * p.element_size() for p in adapters),
    }
    watch = Watch()
    real_clone = torch.Tensor.clone

    # the merge's copies of A and B count as alive memory too
    def tracked_clone(tensor, *args, **kwargs):
        out = real_clone(tensor, *args, **kwargs)
        watch.track(out)
        return out

    torch.Tensor.clone = tracked_clone
    try:
        for label, bucket in (
            ("one bucket", 10 * total),
            ("quarter", total // 4),
            ("small", 3 * largest),
        ):
            runs[label] = {
                "bucket_bytes": bucket,
                **consume(
                    watch, lora.merged_weights(engine.module, bucket), reference, torch.float32
                ),
            }
    finally:
        torch.Tensor.clone = real_clone
    runs["expected_names"] = sorted(
        n.replace("base_model.model.", "").replace(".base_layer", "") for n, _ in adapted
    )
    write_every_rank(runs, out_path, dist)


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    # past the teardown that sometimes aborts a finished rank (grpo_ds.distributed.ranks)
    end_launched_rank(0)
