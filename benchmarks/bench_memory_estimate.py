"""grpo_ds.check's memory estimate against measured peaks, per rank, for several layouts on the CPU.

    python benchmarks/bench_memory_estimate.py [--record] [--configs NAME,...]

A random Qwen2-architecture model (56 M parameters, vocabulary 32,000, float32) is saved once into
--workdir; the mixture-of-experts configurations ("MoE ...") train builtin:tiny as a Qwen3-MoE
instead (MOE: 61 M parameters, 16 experts of which each token uses 2 in each of 8 layers, the
character vocabulary), each family in its own table. Each configuration trains two steps of a real
grpo_ds.train run (the hf rollout engine, 8 prompts x 4 completions of 32 tokens: a random model
over this vocabulary practically never samples EOS, so completions run to the limit), each rank
inside benchmarks/memory_probe.py, which samples its anonymous resident memory (RssAnon, every 5 ms,
glibc's mmap threshold pinned) above what the imports hold. The estimate is grpo_ds.check's for the
same recipe with every completion at the limit (--lengths max). On a CPU machine device and host
memory are the same RAM, so the measured peak is compared with the estimate's device peak plus its
host (offloaded) part. Target: within +-25%. The ranks run oneDNN's AVX2 kernels
(ONEDNN_MAX_CPU_ISA=AVX2, as tests/model/test_lean_bf16.py does): on a CPU with AVX-512 BF16 its
bf16 kernels keep ~25 MiB of host memory of their own, which the estimate (grpo_ds's tensors) does
not count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

SHAPE = dict(
    vocab_size=32_000,
    hidden_size=512,
    intermediate_size=1_408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1_024,
    tie_word_embeddings=False,
)
COMMON = [
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=32",
    "train.micro_batch_samples_per_gpu=8",
    "train.logprob_micro_batch_samples_per_gpu=8",
    "train.steps=2",
    "checkpoint.every_steps=null",
    "logging.progress_bar=false",
    "run.save_final_model=false",
]
# builtin:tiny as a mixture of experts: hidden 384, 8 layers of 16 experts (intermediate 384,
# top-2): 56.6 M of its 61 M parameters are the experts'; its 103-token vocabulary samples EOS now
# and then, so some completions stop early
MOE = [
    "model.path=builtin:tiny",
    "model.tiny_hidden_size=384",
    "model.tiny_num_layers=8",
    "model.tiny_num_heads=8",
    "model.tiny_num_experts=16",
    "model.tiny_experts_per_token=2",
]
CONFIGS = {  # name -> (world size, overrides)
    # what a one-rank run of zero3.json does
    "one rank (ZeRO-1; the rollout shares the policy)": (1, []),
    "ZeRO-3": (1, ["train.zero3_on_one_rank=true"]),
    "ZeRO-3 + optimizer offload": (1, ["deepspeed=ds_configs/zero3_offload.json"]),
    "ZeRO-3 + tp=2": (2, ["train.tensor_parallel_size=2"]),
    "ZeRO-3 + dp=2 + KL reference": (2, ["algorithm.kl_coef=0.05"]),
    "one rank bfloat16 (ZeRO-1; fp32 master)": (1, ["model.dtype=bfloat16"]),
    "one rank bfloat16 lean (ZeRO-1; bf16 master)": (
        1,
        ["model.dtype=bfloat16", "train.lean_bf16=true"],
    ),
    "MoE ZeRO-3": (1, [*MOE, "train.zero3_on_one_rank=true"]),
    "MoE ZeRO-3 + dp=2": (2, MOE),
}
# the title's shape and the model note of each family's table, by whether its names start with "MoE"
FAMILIES = {
    False: (
        "56 M parameters, CPU",
        "random Qwen2 architecture, hidden 512, 8 layers, vocabulary 32,000, 56 M "
        "parameters, float32 unless the configuration says bfloat16",
    ),
    True: (
        "mixture of experts, 61 M parameters, CPU",
        "builtin:tiny as a Qwen3-MoE (" + " ".join(MOE) + "): 61 M "
        "parameters, 56.6 M of them in the experts, float32",
    ),
}


def build_model(folder: Path) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_ds.model.tiny import build_tiny_tokenizer

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**SHAPE)).save_pretrained(folder)
        build_tiny_tokenizer().save_pretrained(folder)
    return 0


def measured(world: int, overrides: list[str], workdir: Path, tag: str) -> list[dict]:
    from tests.launch import clean_env, remove_shm_buffers

    out = workdir / f"{tag}.json"
    env = {**clean_env(), "MALLOC_MMAP_THRESHOLD_": "131072", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    port = 29850 + world
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(world),
        "--master_port",
        str(port),
        str(REPO / "benchmarks" / "memory_probe.py"),
        str(out),
        str(REPO / "recipes" / "tiny_cpu.json"),
        *overrides,
    ]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        remove_shm_buffers(port)
    if proc.returncode:
        raise SystemExit(f"{tag} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def estimated(world: int, overrides: list[str]):
    from grpo_ds.check import estimate_memory, simulated_lengths
    from grpo_ds.model.memory import model_shape
    from grpo_ds.run.preflight import prepare_inputs

    inputs = prepare_inputs(str(REPO / "recipes" / "tiny_cpu.json"), overrides, world, "cpu")
    shape = model_shape(inputs.recipe, len(inputs.tokenizer))
    return estimate_memory(
        inputs.recipe,
        shape,
        inputs.ds_config,
        world,
        simulated_lengths(inputs, "max"),
        backend=inputs.kernels_backend,
    )


def main() -> None:
    from common import markdown_table, report

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="/tmp/grpo_ds_bench_memory_estimate")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS"
    )
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    build_model(workdir / "model")
    tables: dict[bool, list[list]] = {}
    for index, name in enumerate(n.strip() for n in args.configs.split(",")):
        world, extra = CONFIGS[name]
        overrides = [
            f"model.path={workdir / 'model'}",
            f"run.output_dir={workdir / 'runs'}",
            f"run.name=c{index}",
            "run.overwrite=true",
            *COMMON,
            *extra,
        ]
        ranks = measured(world, overrides, workdir, f"c{index}")
        est = estimated(world, overrides)
        peak = max(r["peak_mib"] for r in ranks)
        expected = est.total / 2**20
        error = expected / peak - 1
        phase = max(ranks[0]["phases"], key=ranks[0]["phases"].get)
        row = [
            name,
            world,
            f"{peak:,.0f}",
            phase,
            f"{expected:,.0f}",
            f"{100 * error:+.0f}%",
            "met" if abs(error) <= 0.25 else "NOT met",
        ]
        tables.setdefault(name.startswith("MoE"), []).append(row)
        print(row, flush=True)
    headers = [
        "configuration",
        "world size",
        "measured peak MiB (largest rank)",
        "at phase",
        "estimate MiB",
        "estimate / measured - 1",
        "within 25%",
    ]
    for moe, rows in tables.items():
        shape, model = FAMILIES[moe]
        notes = [
            f"model: {model}; recipe tiny_cpu.json with " + " ".join(COMMON),
            "measured: RssAnon above the imports, sampled every 5 ms in each rank "
            "(benchmarks/memory_probe.py); estimate: grpo_ds.check's "
            "device peak plus its host part, completions at the limit",
            f"{sum(r[-1] == 'met' for r in rows)} of {len(rows)} configurations within +-25%",
        ]
        report(
            "Memory estimate vs measured",
            shape,
            "cpu",
            markdown_table(headers, rows),
            notes,
            args.record,
        )


if __name__ == "__main__":
    main()
