"""Partitioned loading at scale: a >= 300M-parameter model loaded and trained one step at world
sizes 1, 2 and 4.

    python benchmarks/bench_memory_scale.py [--world-sizes 1,2,4] [--record]

The model (Llama architecture, random weights, float32, built from a config in code) is saved once
as safetensors into --workdir. For each world size the script launches itself through the
`deepspeed` launcher (CPU, gloo); every rank loads the model with grpo_ds.model.loading.load_model
under the resolved ZeRO-3 config (born partitioned), builds the training engine
(grpo_ds.model.engine.create_train_engine), takes the logits of a fixed batch, and runs one
optimizer step through grpo_ds.step.update.optimizer_step on fixed rollouts. Memory is each rank's
anonymous resident set (RssAnon, sampled every 5 ms, glibc's mmap threshold pinned so that freed
buffers go back to the OS) above what it held after the imports:

    loaded        after the partitioned load (this rank's slice of the weights)
    model states  after the optimizer step: weights, gradients and Adam states (ZeRO-3 shards all
                  three)
    peak          the most held at once during load, engine build and step

The table shows the largest rank at each world size and model states x world size, which stays flat
when every rank holds 1/dp; the logits are compared bit for bit with world size 1's. DeepSpeed's
reduce and prefetch buckets are set to 5M elements so that its constant buffers do not hide the 1/dp
term.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

SHAPE = dict(
    vocab_size=32_000,
    hidden_size=1_024,
    intermediate_size=2_816,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=512,
)
BUCKET = 5_000_000  # elements: DeepSpeed's reduce / prefetch buckets (defaults 5e8 / 5e7)


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))


class PeakSampler:
    def __init__(self) -> None:
        self.peak = rss_anon_mib()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_anon_mib())
            time.sleep(0.005)


def build_model(folder: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_ds.model.tiny import build_tiny_tokenizer

    if (folder / "config.json").is_file():
        return json.loads((folder / "params.json").read_text())["params"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    (folder / "params.json").write_text(json.dumps({"params": params}))
    return params


def rank_job(folder: str, out: str) -> None:
    """One rank: load partitioned, build the engine, logits, one optimizer step; write this rank's
    figures."""
    import torch

    from grpo_ds.config.deepspeed import resolve_deepspeed_config
    from grpo_ds.config.loading import load_recipe
    from grpo_ds.distributed.ranks import init_distributed
    from grpo_ds.model.engine import create_train_engine
    from grpo_ds.model.loading import load_model
    from grpo_ds.step.batch import StepBatch
    from grpo_ds.step.plan import plan_minibatch
    from grpo_ds.step.update import UpdateSettings, optimizer_step
    from tests.scripts.one_step import fixed_rollouts

    sampler = PeakSampler()
    dist = init_distributed()
    time.sleep(0.05)
    base = rss_anon_mib()
    sampler.peak = base
    recipe = load_recipe(
        {
            "model": {"path": folder},
            "rollout": {"prompts_per_step": 2, "group_size": 4},
            "train": {"micro_batch_samples_per_gpu": 8, "lr": 1e-4},
            "deepspeed": {
                "zero_optimization": {
                    "stage": 3,
                    "reduce_bucket_size": BUCKET,
                    "stage3_prefetch_bucket_size": BUCKET,
                }
            },
        }
    )
    ds_config = resolve_deepspeed_config(recipe, dist.world_size, "cpu")
    model = load_model(recipe.model, 0, 0, ds_config)
    loaded = rss_anon_mib() - base
    local = sum(p.ds_tensor.numel() for p in model.parameters())
    engine = create_train_engine(model, ds_config)
    ids = torch.arange(3, 35).view(2, 16)
    with torch.no_grad():
        logits = engine(input_ids=ids, use_cache=False).logits.float()
    rollouts, advantages = fixed_rollouts(8, seed=0)
    tokens = {
        i: len(p) + len(r)
        for i, (p, r) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids, strict=True))
    }
    plan = plan_minibatch(list(tokens), tokens, dist.world_size, max_samples=8)
    settings = UpdateSettings.from_recipe(recipe, pad_id=0, backend="torch")
    optimizer_step(engine, StepBatch([], rollouts, [], advantages=advantages), plan, settings, dist)
    states = rss_anon_mib() - base
    result = {
        "rank": dist.rank,
        "loaded_mib": loaded,
        "states_mib": states,
        "peak_mib": sampler.peak - base,
        "local_params": local,
    }
    Path(f"{out}.rank{dist.rank}").write_text(json.dumps(result))
    if dist.is_main:
        torch.save(logits, f"{out}.logits.pt")
    dist.barrier()


def launch(world: int, folder: Path, out: Path) -> list[dict]:
    from tests.launch import clean_env, remove_shm_buffers

    env = {
        **clean_env(),
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "OMP_NUM_THREADS": str(max(1, 2 // world)),
    }
    port = 29800 + world
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(world),
        "--master_port",
        str(port),
        __file__,
        "--rank-job",
        str(folder),
        str(out),
    ]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        remove_shm_buffers(port)
    if proc.returncode:
        raise SystemExit(f"world size {world} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def main() -> None:
    import torch
    from common import markdown_table, report

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--workdir", default="/tmp/grpo_ds_bench_memory_scale")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument("--rank-job", nargs=2, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.rank_job:
        rank_job(*args.rank_job)
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    params = build_model(workdir / "model")
    worlds = [int(w) for w in args.world_sizes.split(",")]
    rows, first_logits, first_states = [], None, None
    for world in worlds:
        ranks = launch(world, workdir / "model", workdir / f"w{world}")
        logits = torch.load(workdir / f"w{world}.logits.pt")
        first_logits = logits if first_logits is None else first_logits
        worst = max(ranks, key=lambda r: r["states_mib"])
        first_states = first_states or worst["states_mib"] * worlds[0]
        rows.append(
            [
                world,
                f"{worst['local_params'] / 1e6:.1f}",
                f"{worst['loaded_mib']:,.0f}",
                f"{worst['states_mib']:,.0f}",
                f"{worst['states_mib'] * world / first_states:.3f}",
                f"{worst['peak_mib']:,.0f}",
                f"{(logits - first_logits).abs().max().item():.1e}",
            ]
        )
        print(rows[-1], flush=True)
    headers = [
        "world size",
        "M params per rank",
        "loaded MiB",
        "model states MiB",
        "states x world / world 1's",
        "peak MiB",
        "max abs logit diff vs world 1",
    ]
    body = markdown_table(headers, rows)
    scaled = [float(r[4]) for r in rows]
    notes = [
        f"model: Llama architecture, {params / 1e6:.0f} M parameters, float32, random weights "
        "saved once as safetensors; ZeRO-3, AdamW, one optimizer step on 8 fixed samples; memory = "
        "RssAnon above the imports, largest rank",
        f"1/dp: model states x world size within {100 * max(abs(s - 1) for s in scaled):.0f}% of "
        "world size 1's (target 20%): "
        f"{'met' if max(abs(s - 1) for s in scaled) <= 0.2 else 'NOT met'}",
        "logits after loading: "
        + (
            "identical at every world size"
            if all(r[6] == "0.0e+00" for r in rows)
            else "differ (see the last column)"
        ),
    ]
    report(
        "Partitioned loading at scale",
        f"{params / 1e6:.0f} M parameters, world sizes {args.world_sizes}",
        "cpu",
        body,
        notes,
        args.record,
    )


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
