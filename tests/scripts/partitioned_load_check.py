"""Load models partitioned under ZeRO-3 (launched by `deepspeed` at world size 2): the partitions,
the weights, the logits, and LoRA on a partitioned base.

    deepspeed --num_gpus 2 tests/scripts/partitioned_load_check.py OUT_DIR HF_MODEL_DIR

For builtin:tiny and for a saved Hugging Face folder: each rank holds ceil(numel / world) elements
of every weight (nothing whole), the gathered weights equal a plain (unpartitioned) load bit for
bit, and so do the logits of a forward through a ZeRO-3 engine. Then a LoRA engine over the
partitioned base takes one step. Rank 0 writes OUT_DIR/result.json.
"""

import json
import math
import sys
from pathlib import Path

import torch

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import end_launched_rank, init_distributed
from grpo_ds.model.engine import create_reference_engine, create_train_engine
from grpo_ds.model.loading import load_model
from grpo_ds.model.lora import apply_lora
from grpo_ds.model.weight_gather import gathered_named_parameters

VOCAB = 64
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def check(path: str, dist) -> dict:
    recipe = load_recipe(
        {
            "model": {
                "path": path,
                "tiny_hidden_size": 32,
                "tiny_num_layers": 2,
                "tiny_num_heads": 4,
            },
            "deepspeed": ZERO3,
        }
    )
    ds_config = resolve_deepspeed_config(recipe, dist.world_size, "cpu")
    model = load_model(recipe.model, VOCAB, seed=3, ds_config=ds_config)
    shards = {
        name: (p.ds_tensor.numel(), math.ceil(p.ds_numel / dist.world_size))
        for name, p in model.named_parameters()
    }
    local = sum(p.ds_tensor.numel() for p in model.parameters())
    plain = load_model(recipe.model, VOCAB, seed=3)
    expected = dict(plain.named_parameters())
    engine = create_reference_engine(model, ds_config)
    gathered = {
        name: torch.equal(tensor, expected[name].detach())
        for name, tensor in gathered_named_parameters(engine.module, 2**20)
    }
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_equal = torch.equal(engine(input_ids=ids).logits, plain(input_ids=ids).logits)
    return {
        "shards_ok": all(a == b for a, b in shards.values()),
        "local": local,
        "total": sum(p.numel() for p in plain.parameters()),
        "weights_equal": all(gathered.values()),
        "weights_compared": len(gathered),
        "logits_equal": logits_equal,
    }


def lora_step(dist) -> dict:
    recipe = load_recipe(
        {
            "model": {
                "tiny_hidden_size": 32,
                "tiny_num_layers": 2,
                "tiny_num_heads": 4,
                "lora_rank": 4,
            },
            "deepspeed": ZERO3,
        }
    )
    ds_config = resolve_deepspeed_config(recipe, dist.world_size, "cpu")
    model = apply_lora(load_model(recipe.model, VOCAB, seed=3, ds_config=ds_config), recipe.model)
    engine = create_train_engine(model, ds_config)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    return {
        "lora_loss": loss.item(),
        "lora_trainable_partitioned": all(
            hasattr(p, "ds_id") for p in engine.module.parameters() if p.requires_grad
        ),
    }


def main(out_dir: str, hf_dir: str) -> None:
    dist = init_distributed()
    result = {"tiny": check("builtin:tiny", dist), "hf": check(hf_dir, dist), **lora_step(dist)}
    if dist.is_main:
        (Path(out_dir) / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(*args)
    # past the teardown that sometimes aborts a finished rank (grpo_ds.distributed.ranks)
    end_launched_rank(0)
