"""Benchmark the weight sync (grpo_ds/model/weight_gather.py): ZeRO-3 shards -> full weights -> a
rollout engine.

Runs itself on N CPU ranks through the real `deepspeed` launcher (gloo), with a Llama-style model of
a few hundred tensors partitioned by ZeRO-3, and times one full sync into a rollout engine, the same
consumer for every variant: the hf engine's policy copy (``--consumer hf``), or a vLLM engine per
rank (``--consumer vllm``: vLLM's CPU build reloading its weights in place; run it with the vLLM
test environment's interpreter, e.g.
``.venv-vllm/bin/python benchmarks/bench_weight_sync.py --consumer vllm``). Variants:
    per-tensor        one GatheredParameters per parameter: a blocking collective per tensor (TRL,
                      OpenRLHF)
    ds-bucket/<MB>    DeepSpeed's GatheredParameters on a bucket of parameters (grpo_ds's exporter
                      before this one): DeepSpeed still launches one all_gather per parameter, then
                      waits for them all
    grpo_ds/<MB>      grpo_ds's exporter: the bucket's shards packed into one buffer, ONE all_gather
                      per bucket
Columns: median time of a sync, collectives per sync (counted in deepspeed.comm, which both
DeepSpeed and grpo_ds call), and the peak of gathered bytes alive at once (buffers of the
collectives plus handed-out copies).

    python benchmarks/bench_weight_sync.py [--ranks 2] [--layers 32] [--hidden 128] [--bucket-mb
        1,4,16]
                                           [--consumer hf|vllm] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# this checkout's grpo_ds in the launched ranks too, whatever is installed
sys.path.insert(0, str(REPO))

MIB = 2**20


# -------------------------------------------------------------------------------- worker (one rank)


class _Watch:
    """Counts deepspeed.comm all-gathers and tracks the storages of gathered buffers and handed-out
    tensors."""

    def __init__(self):
        import deepspeed.comm as ds_comm

        self.collectives, self.storages = 0, []
        for name in ("all_gather_into_tensor", "all_gather"):
            setattr(ds_comm, name, self._counting(getattr(ds_comm, name)))

    def _counting(self, real):
        def wrapper(output, *args, **kwargs):
            self.collectives += 1
            for t in output if isinstance(output, list) else [output]:
                self.track(t)
            return real(output, *args, **kwargs)

        return wrapper

    def track(self, tensor) -> None:
        self.storages.append(weakref.ref(tensor.untyped_storage()))

    def alive_bytes(self) -> int:
        live = {id(s): s.nbytes() for s in (r() for r in self.storages) if s is not None}
        return sum(live.values())


def _per_tensor(module):
    import deepspeed

    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield name, param.data


def _ds_buckets(module, bucket_bytes: int):
    import deepspeed

    bucket, size = [], 0
    params = list(module.named_parameters())
    for i, (name, param) in enumerate(params):
        bucket.append((name, param))
        size += param.ds_numel * param.element_size()
        if size >= bucket_bytes or i == len(params) - 1:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                for n, p in bucket:
                    yield n, p.data
            bucket, size = [], 0


def worker(args: argparse.Namespace) -> None:
    import torch

    from grpo_ds.config.deepspeed import resolve_deepspeed_config
    from grpo_ds.config.loading import load_recipe
    from grpo_ds.distributed.ranks import init_distributed
    from grpo_ds.model.engine import create_train_engine
    from grpo_ds.model.tiny import build_tiny_model
    from grpo_ds.model.weight_gather import gathered_named_parameters
    from grpo_ds.rollout.hf import HFRolloutEngine

    dist = init_distributed()
    model = build_tiny_model(
        args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seed=0
    )
    consumer = build_tiny_model(
        args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seed=1
    )
    if args.consumer == "vllm":
        from grpo_ds.model.tiny import build_tiny_tokenizer
        from grpo_ds.rollout.vllm import VLLMRolloutEngine, VLLMSettings

        settings = VLLMSettings(
            "builtin:tiny",
            "float32",
            1,
            0.05,
            64,
            False,
            0,
            False,
            enforce_eager=True,
            kv_cache_gib=1,
        )
        rollout = VLLMRolloutEngine(settings, build_tiny_tokenizer(), lambda: consumer)
    else:
        rollout = HFRolloutEngine(consumer, 0, 1, 1)
    recipe = load_recipe(
        {"deepspeed": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}}
    )
    engine = create_train_engine(model, resolve_deepspeed_config(recipe, dist.world_size, "cpu"))
    module = engine.module
    watch = _Watch()
    variants = {"per-tensor": lambda: _per_tensor(module)}
    for mb in args.bucket_mb:
        variants[f"ds-bucket/{mb:g}"] = lambda mb=mb: _ds_buckets(module, int(mb * MIB))
    for mb in args.bucket_mb:
        variants[f"grpo_ds/{mb:g}"] = lambda mb=mb: gathered_named_parameters(module, int(mb * MIB))

    def watched(stream, peak: list[int]):
        for name, tensor in stream:
            watch.track(tensor)
            peak[0] = max(peak[0], watch.alive_bytes())
            yield name, tensor

    results = []
    for name, make in variants.items():
        times, collectives, peaks = [], [], []
        for i in range(args.warmup + args.repeats):
            watch.collectives, watch.storages, peak = 0, [], [0]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            count = rollout.update_weights(watched(make(), peak))
            torch.distributed.barrier()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
                collectives.append(watch.collectives)
                peaks.append(peak[0])
        results.append(
            {
                "variant": name,
                "ms": times,
                "collectives": collectives,
                "peak_bytes": max(peaks),
                "tensors": count,
            }
        )
    if dist.is_main:
        params = list(module.parameters())
        info = {
            "tensors": len(params),
            "param_bytes": sum(p.ds_numel * p.element_size() for p in params),
            "largest_bytes": max(p.ds_numel * p.element_size() for p in params),
            "world": dist.world_size,
            "consumer": args.consumer,
        }
        Path(args.worker_out).write_text(json.dumps({"info": info, "results": results}))
    dist.barrier()
    # vLLM's shutdown takes the process group down: after the last collective
    if hasattr(rollout, "close"):
        rollout.close()


# ------------------------------------------------------------------------------------- the launcher


def launch(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run this script on ``args.ranks`` CPU ranks with the deepspeed launcher; returns rank 0's
    figures."""
    import socket

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = Path(tmp) / "figures.json"
        launcher = Path(sys.executable).parent / "deepspeed"
        cmd = [
            str(launcher) if launcher.exists() else "deepspeed",
            "--num_gpus",
            str(args.ranks),
            "--master_port",
            str(port),
            __file__,
            *argv,
            "--worker-out",
            str(out),
        ]
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        env.update(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
        s.close()
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr)[-4000:]}"
            )
        return json.loads(out.read_text())


def render(figures: dict) -> tuple[str, list[str]]:
    from common import fmt, markdown_table

    rows, base = [], None
    for r in figures["results"]:
        ms = statistics.median(r["ms"])
        base = ms if r["variant"] == "per-tensor" else base
        rows.append(
            [
                r["variant"],
                fmt(ms, 1),
                f"{statistics.median(r['collectives']):g}",
                fmt(r["peak_bytes"] / MIB, 2),
                fmt(base / ms, 2) + "x" if base else "-",
            ]
        )
    headers = [
        "variant",
        "sync ms (median)",
        "collectives per sync",
        "peak gathered MiB",
        "speedup vs per-tensor",
    ]
    table = markdown_table(headers, rows)
    info = figures["info"]
    notes = [
        f"{info['tensors']} tensors, {info['param_bytes'] / MIB:,.1f} MiB of fp32 weights (largest "
        f"tensor {info['largest_bytes'] / MIB:,.2f} MiB), "
        f"ZeRO-3 over {info['world']} CPU ranks (gloo)",
        (
            "a sync: every full tensor copied into the hf engine's policy copy"
            if info.get("consumer", "hf") == "hf"
            else "a sync: every full tensor loaded into a vLLM engine per rank (vLLM's CPU build: "
            "reload_weights, which rebuilds and repacks each layer, then a prefix-cache reset)"
        )
        + "; time from a barrier to a barrier on rank 0, median of the repeats after the warmup",
        "peak gathered: the most bytes of collective buffers "
        "and handed-out copies alive at once during a sync",
    ]
    return table, notes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--layers", type=int, default=32, help="decoder layers (9 tensors each, plus 3)"
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--bucket-mb", default="1,4,16", help="comma-separated bucket sizes in MiB")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--timeout", type=int, default=600, help="seconds the launched ranks may take"
    )
    parser.add_argument(
        "--consumer", choices=("hf", "vllm"), default="hf", help="the rollout engine synced into"
    )
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    # set when launched as a rank
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    # set by `deepspeed`
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.bucket_mb = [float(v) for v in args.bucket_mb.split(",") if v.strip()]
    if args.worker_out is not None:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
    from common import report

    forwarded = [a for a in sys.argv[1:] if a != "--record"]
    figures = launch(args, forwarded)
    table, notes = render(figures)
    shape = (
        f"{figures['info']['tensors']} tensors, {args.layers} layers x hidden {args.hidden}, vocab "
        f"{args.vocab}, {args.ranks} CPU ranks"
    )
    report("bench_weight_sync", shape, "cpu", table, notes, args.record)


if __name__ == "__main__":
    main()
