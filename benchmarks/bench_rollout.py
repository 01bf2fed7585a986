"""The hf rollout engine's generation against a plain transformers ``generate`` (what TRL's
GRPOTrainer calls).

Issue 18's realistic CPU shape by default: a random Qwen2-architecture model built from a config in
code (vocabulary 151,936, hidden 256, 4 layers, tied embeddings, about 42 M parameters), 8 prompts x
8 completions of 64 new tokens, float32, 2 threads. The variants sample with the same settings from
the same left-padded batch and the same seed:

    grpo_ds    HFRolloutEngine.generate: the tokens and their sampler log-probs, recorded one step
               at a time (grpo_ds.rollout.hf.TokenSampler), eager (rollout.hf_compile "off")
    compiled   the same engine with rollout.hf_compile "on": a static KV cache and a torch.compile'd
               decode step (CUDA graphs on a GPU), grpo_ds.rollout.hf_compile; its first, untimed
               call compiles (the table shows how long that call took) and a row says "fell back" if
               the compile failed or stalled
    all_steps  the same engine with the log-prob path it had before: generate keeps every step's
               scores (output_scores) and they are log-softmaxed and stacked at the end (the
               reference in tests/rollout/test_hf.py)
    generate   model.generate(..., generation_config=...) returning the sequences only, no scores
    vllm       grpo_ds.rollout.vllm.VLLMRolloutEngine.generate on the model saved to a folder:
               vLLM's CPU build, run in the vLLM test environment's interpreter (--vllm-python,
               default .venv-vllm/bin/python: bash .ci/vllm-venv builds it); left out where there is
               none

--device cuda --dtype bfloat16 --shape qwen2-0.5b measures the GPU shape of issue 38: a random
Qwen2.5-0.5B-shaped model (bench_vs_trl.QWEN2_05B: hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4,864, vocabulary 151,936), 16 prompts x 8 completions x 256 new tokens; about 1-2
minutes for grpo_ds, compiled and generate on an H100/H200:

    python benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --shape qwen2-0.5b \
        --variants grpo_ds,compiled,generate --record

Per variant: the median wall time and process CPU time of ``--repeats`` calls after ``--warmup``
untimed ones, ms per generated token step, and the peak extra resident memory of a call
(benchmarks/common.py's CPU method: the resident-set high-water mark reset just before; glibc's mmap
threshold is pinned at 128 KiB when the script starts the variants so that freed tensors go back to
the OS; on CUDA: torch.cuda.max_memory_allocated). Each variant runs in its own process, one after
the other.

    python benchmarks/bench_rollout.py                  # every variant, a table
    python benchmarks/bench_rollout.py --variant grpo_ds  # one variant in this process
    python benchmarks/bench_rollout.py --record         # append the table to benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("grpo_ds", "compiled", "all_steps", "generate", "vllm")
# --shape: the model and the batch; --vocab/--hidden/--layers/--prompts/--new-tokens override the
# realistic one only
SHAPES = {
    "realistic": "a random Qwen2 over a 151,936-token vocabulary (hidden 256, 4 layers by "
    "default), 8 prompts x 8 completions of 64 new tokens by default",
    "qwen2-0.5b": "a random Qwen2.5-0.5B-shaped model (0.49 B), "
    "16 prompts x 8 completions of 256 new tokens",
}
REPO = Path(__file__).resolve().parent.parent
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variant",
        choices=("all", *VARIANTS),
        default="all",
        help="all: each variant of --variants in its own process, then a table",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="with --variant all: the variants to run, comma-separated (default: all; vllm and "
        "all_steps are left out on cuda)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="realistic",
        help="; ".join(f"{k}: {v}" for k, v in SHAPES.items()),
    )
    parser.add_argument(
        "--compile-timeout",
        type=float,
        default=300.0,
        help="compiled variant: rollout.hf_compile_timeout_s",
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument(
        "--prompt-len", type=int, default=16, help="longest prompt; the others are shorter"
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="with one --variant: also print torch.profiler's "
        "top ROWS ops (self CPU time) of one call",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON line (used by --variant all)"
    )
    parser.add_argument(
        "--vllm-python",
        default=str(REPO / ".venv-vllm" / "bin" / "python"),
        help="the interpreter of the vllm variant (an environment with vLLM)",
    )
    parser.add_argument(
        "--vllm-eager", action="store_true", help="vllm variant: enforce_eager (no compilation)"
    )
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    return parser.parse_args(argv)


def shaped(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the qwen2-0.5b shape's batch (16 prompts x 8 completions x 256 new tokens)
    filled in."""
    if args.shape == "qwen2-0.5b":
        args.prompts, args.group, args.new_tokens, args.vocab = 16, 8, 256, 151936
    return args


def build_model(args: argparse.Namespace):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    if args.shape == "qwen2-0.5b":
        from bench_vs_trl import QWEN2_05B

        config = Qwen2Config(**QWEN2_05B)
    else:
        config = Qwen2Config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    # built on the device: the 0.5 B model's random init is slow on a CPU
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config)
    return model.to(getattr(torch, args.dtype)).eval()


def vllm_engine(args: argparse.Namespace, model):
    """The vllm rollout engine on ``model``, saved with the builtin character tokenizer (vLLM's
    sampler never decodes: the single-turn engine asks for token ids only)."""
    import os
    import tempfile

    from grpo_ds.distributed.ranks import init_distributed
    from grpo_ds.model.tiny import build_tiny_tokenizer
    from grpo_ds.rollout.vllm import VLLMRolloutEngine, VLLMSettings

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_distributed()
    folder = tempfile.mkdtemp(prefix="bench_rollout_vllm_")
    tokenizer = build_tiny_tokenizer()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings = VLLMSettings(
        folder,
        "float32",
        1,
        0.2,
        args.prompt_len + args.new_tokens,
        False,
        args.seed,
        False,
        enforce_eager=args.vllm_eager,
        kv_cache_gib=1,
    )
    return VLLMRolloutEngine(settings, tokenizer, lambda: None)


def run_variant(args: argparse.Namespace) -> dict:
    import torch
    from common import _PeakMemory
    from transformers import GenerationConfig

    from grpo_ds.rollout import hf
    from grpo_ds.rollout.base import SamplingParams
    from grpo_ds.rollout.hf_compile import CompiledDecode

    torch.set_num_threads(args.threads)
    model = build_model(args)
    pad, eos = 0, 1
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(2, args.vocab, (args.prompt_len - i % 4,), generator=g).tolist()
        for i in range(args.prompts)
    ]
    sampling = SamplingParams(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.variant == "vllm":
        engine = vllm_engine(args, model)

        def call() -> int:
            out = engine.generate(prompts, args.group, sampling)
            return max(len(r) for r in out.response_ids)
    elif args.variant in ("grpo_ds", "compiled", "all_steps"):
        if args.variant == "all_steps":
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.rollout.test_hf import all_steps_generate_left_padded

            hf.generate_left_padded = all_steps_generate_left_padded
        compiled = (
            CompiledDecode(args.device, args.compile_timeout)
            if args.variant == "compiled"
            else None
        )
        engine = hf.HFRolloutEngine(model, pad, eos, batch_prompts=args.prompts, compiled=compiled)

        def call() -> int:
            out = engine.generate(prompts, args.group, sampling)
            return max(len(r) for r in out.response_ids)
    else:
        input_ids, attention_mask = (t.to(args.device) for t in hf.left_padded(prompts, pad))
        sampled = (
            {
                "do_sample": True,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
            }
            if args.temperature > 0
            else {"do_sample": False}
        )
        config = GenerationConfig(
            **sampled,
            max_new_tokens=args.new_tokens,
            num_return_sequences=args.group,
            pad_token_id=pad,
            eos_token_id=eos,
            use_cache=True,
        )

        @torch.no_grad()
        def call() -> int:
            torch.manual_seed(args.seed)
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )
            return out.shape[1] - input_ids.shape[1]

    first = time.perf_counter()
    # untimed: first-call allocations and thread start-up (compiled: the compile)
    for _ in range(args.warmup):
        call()
    first = time.perf_counter() - first
    times, cpu_times, peaks, steps = [], [], [], 0
    for _ in range(args.repeats):
        memory = _PeakMemory(args.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        steps = call()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        peaks.append(memory.peak_extra_mib())
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            call()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))
    median = statistics.median(times)
    fell_back, cache_mib = None, 0.0
    # its static caches outlive a call: allocated by the warm-up, not in the peak
    if args.variant == "compiled":
        fell_back = engine.compiled.failed
        cache_mib = (
            sum(
                t.nbytes
                for cache in engine.compiled.caches.values()
                for layer in cache.layers
                if getattr(layer, "is_initialized", False)
                for t in (layer.keys, layer.values)
            )
            / 2**20
        )
    return {
        "variant": args.variant,
        "seconds": median,
        "cpu_seconds": statistics.median(cpu_times),
        "ms_per_step": 1000 * median / steps,
        "steps": steps,
        "peak_extra_mib": max(peaks),
        "warmup_seconds": first,
        "fell_back": fell_back,
        "cache_mib": cache_mib,
    }


def main(argv: list[str] | None = None) -> None:
    args = shaped(parse_args(argv))
    if args.variant != "all":
        row = run_variant(args)
        print(json.dumps(row) if args.json else row)
        return
    rows = []
    chosen = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(chosen) - set(VARIANTS)):
        raise SystemExit(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    if args.device == "cuda":  # vLLM's CPU build; every step's scores at this shape: 20 GB
        chosen = [v for v in chosen if v not in ("vllm", "all_steps")]
    for variant in (v for v in VARIANTS if v in chosen):
        python = args.vllm_python if variant == "vllm" else sys.executable
        if not Path(python).is_file():
            print(f"{variant}: no interpreter at {python}, left out", file=sys.stderr)
            continue
        cmd = [
            python,
            __file__,
            *(argv if argv is not None else sys.argv[1:]),
            "--variant",
            variant,
            "--json",
        ]
        cmd = [c for c in cmd if c != "--record"]
        env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(REPO)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{variant} failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["variant"] == "generate"), rows[0])
    model = (
        "Qwen2.5-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 KV heads)"
        if args.shape == "qwen2-0.5b"
        else f"hidden {args.hidden}, {args.layers} layers"
    )
    shape = (
        f"vocab {args.vocab}, {model}, {args.prompts} prompts x {args.group} completions x "
        f"{args.new_tokens} new tokens, {args.dtype}, {args.device}"
        + (f", {args.threads} threads" if args.device == "cpu" else "")
    )
    memory = "peak extra CUDA MiB" if args.device == "cuda" else "peak extra RSS MiB"
    lines = [
        "| variant | wall s (median) | ms / token step | generated tokens/s | wall vs "
        f"{base['variant']} | CPU s (median) | CPU vs "
        f"{base['variant']} | {memory} | first call s |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        tokens = args.prompts * args.group * r["steps"]
        name = r["variant"] + (" (fell back to eager)" if r.get("fell_back") else "")
        lines.append(
            f"| {name} | {r['seconds']:.2f} | {r['ms_per_step']:.1f} | "
            f"{tokens / r['seconds']:,.0f} | {r['seconds'] / base['seconds']:.2f}x | "
            f"{r['cpu_seconds']:.2f} | {r['cpu_seconds'] / base['cpu_seconds']:.2f}x | "
            f"{r['peak_extra_mib']:.0f} | {r['warmup_seconds']:.1f} |"
        )
    notes = [
        f"sampling: temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}; median "
        f"of {args.repeats} calls after {args.warmup} untimed, each variant in its own process",
        "plain generate: model.generate on the same left-padded batch and settings, sequences only "
        "(what TRL's GRPOTrainer calls); grpo_ds adds the sampled tokens' log-probs",
        "CPU s: the process's CPU time during the call (all "
        "threads), steadier than wall time on a shared machine",
        f"first call s: the {args.warmup} untimed call(s) before the timed ones; compiled: "
        "includes the compile (rollout.hf_compile); a "
        "compiled row marked 'fell back' generated eagerly",
        "generated tokens/s: prompts x completions x the longest completion's tokens / wall s (a "
        "random model over this vocabulary practically never "
        "samples EOS, so every completion has the same length)",
    ]
    if any(r["variant"] == "vllm" for r in rows):
        shown = os.path.relpath(args.vllm_python, REPO)
        notes.append(
            f"vllm: vLLM's CPU build in its own environment ({shown}), float32, "
            f"{'enforce_eager' if args.vllm_eager else 'compiled (torch.compile, its default)'}, "
            "one engine, the same prompts, one request per prompt "
            "with n = completions; its CPU threads are vLLM's own"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from common import report

    torch.set_num_threads(args.threads)
    for r in rows:
        if r.get("fell_back"):
            notes.append(f"{r['variant']}: compiled decoding {r['fell_back']}")
        if r.get("cache_mib"):
            notes.append(
                f"{r['variant']}: its static KV cache, {r['cache_mib']:.1f} MiB, is allocated by "
                "the first call and kept between calls, so it "
                "is not in the peak extra memory of a timed call"
            )
    report("bench_rollout", shape, args.device, "\n".join(lines), notes, args.record)


if __name__ == "__main__":
    main()
