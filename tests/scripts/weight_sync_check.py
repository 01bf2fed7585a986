"""The bucketed ZeRO-3 exporter on several ranks (launched by `deepspeed`; read by
tests/model/test_weight_gather.py).

    deepspeed --num_gpus 2 tests/scripts/weight_sync_check.py OUT.json

A tiny Llama with tied input/output embeddings is partitioned by ZeRO-3; every collective
DeepSpeed's comm layer runs is counted (grpo_ds and DeepSpeed both call deepspeed.comm), and the
storage of every gathered buffer and every tensor handed out is watched, so that at each yield the
bytes of gathered weights still alive are known (weak references: a freed or emptied storage counts
0). Rank 0 writes one JSON record per run.
"""

import copy
import json
import sys
import weakref
from pathlib import Path

# this checkout's grpo_ds, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed
import deepspeed.comm as ds_comm
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import end_launched_rank, init_distributed
from grpo_ds.model.engine import create_train_engine
from grpo_ds.model.weight_gather import gathered_named_parameters


class Watch:
    """Counts collectives and tracks the storages of gathered buffers and handed-out tensors."""

    def __init__(self):
        self.collectives, self.collective_bytes, self.storages = 0, [], []
        for name in ("all_gather_into_tensor", "all_gather"):
            setattr(ds_comm, name, self._counting(getattr(ds_comm, name)))

    def _counting(self, real):
        def wrapper(output, *args, **kwargs):
            outputs = output if isinstance(output, list) else [output]
            self.collectives += 1
            self.collective_bytes.append(sum(t.numel() * t.element_size() for t in outputs))
            for t in outputs:
                self.track(t)
            return real(output, *args, **kwargs)

        return wrapper

    def track(self, tensor):
        self.storages.append(weakref.ref(tensor.untyped_storage()))

    def alive_bytes(self) -> int:
        live = {}
        for ref in self.storages:
            storage = ref()
            if storage is not None:
                live[id(storage)] = storage.nbytes()
        return sum(live.values())

    def reset(self):
        self.collectives, self.collective_bytes, self.storages = 0, [], []


def consume(watch, stream, reference, dtype):
    """Read the stream as a rollout engine would (use each tensor, keep nothing) and record what
    happened."""
    watch.reset()
    names, peak, max_error = [], 0, 0.0
    for name, tensor in stream:
        watch.track(tensor)
        peak = max(peak, watch.alive_bytes())
        names.append(name)
        expected = reference[name].to(dtype)
        assert tensor.dtype == dtype, (name, tensor.dtype)
        max_error = max(max_error, (tensor.float() - expected.float()).abs().max().item())
    return {
        "names": names,
        "collectives": watch.collectives,
        "collective_bytes": watch.collective_bytes,
        "peak_alive_bytes": peak,
        "max_abs_error": max_error,
        "alive_after": watch.alive_bytes(),
    }


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
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = {
        n: p.detach().clone()
        for n, p in copy.deepcopy(model).named_parameters(remove_duplicate=False)
    }
    recipe = load_recipe(
        {"deepspeed": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}}
    )
    engine = create_train_engine(model, resolve_deepspeed_config(recipe, dist.world_size, "cpu"))
    params = list(engine.module.parameters())
    # partitioned, nothing held outside a gather
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
    padded = [p.ds_tensor.ds_numel * dist.world_size * p.ds_tensor.element_size() for p in params]
    watch = Watch()
    runs = {
        "tensors": len(params),
        "padded_bytes": sum(padded),
        "largest_padded_bytes": max(padded),
        "module_names": [n for n, _ in engine.module.named_parameters()],
    }
    total = sum(padded)
    norm = dict(engine.module.named_parameters())["model.norm.weight"]
    runs["dropped_padded_bytes"] = (
        norm.ds_tensor.ds_numel * dist.world_size * norm.ds_tensor.element_size()
    )
    for label, bucket in (
        ("one bucket", 10 * total),
        ("quarter", total // 4),
        ("small", 3 * max(padded)),
    ):
        runs[label] = {
            "bucket_bytes": bucket,
            **consume(
                watch, gathered_named_parameters(engine.module, bucket), reference, torch.float32
            ),
        }
    bucket = total // 4
    # dropped, so never gathered; everything else gets a prefix
    rename = {"model.norm.weight": None}
    runs["bf16 tied all renamed"] = {
        "bucket_bytes": bucket,
        **consume(
            watch,
            (
                (n.removeprefix("vllm."), t)
                for n, t in gathered_named_parameters(
                    engine.module,
                    bucket,
                    dtype=torch.bfloat16,
                    tied="all",
                    rename=lambda n: rename.get(n, "vllm." + n),
                )
            ),
            reference,
            torch.bfloat16,
        ),
    }
    # the per-tensor baseline (as TRL and OpenRLHF do): one GatheredParameters per parameter
    watch.reset()
    for p in params:
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            pass
    runs["per-tensor collectives"] = watch.collectives
    write_every_rank(runs, out_path, dist)


def write_every_rank(record: dict, out_path: str, dist) -> None:
    """Rank 0 writes every rank's record, in rank order, as one JSON list."""
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, record)
    if dist.is_main:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    # past the teardown that sometimes aborts a finished rank (grpo_ds.distributed.ranks)
    end_launched_rank(0)
