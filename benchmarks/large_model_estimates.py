"""grpo_ds.check's memory estimate for 7B, 32B and 72B models on one node of 8 x 80 GiB GPUs
(estimates, not runs).

    python benchmarks/large_model_estimates.py [--update-docs] [--record]

Each model is a config folder written here (Qwen2.5-7B/32B/72B's published shapes, no weights: the
dry run builds models on the meta device) with the builtin tokenizer. Each layout is a grpo_ds.check
run: 8 ranks, bfloat16, the vLLM rollout engine with sleep mode (its tensor-parallel group sized to
hold the model), gradient checkpointing, 1,024-token completions and 512-token prompts budgeted per
micro-batch, on the builtin data. ``--update-docs`` rewrites the table between the "large-models"
markers of docs/guides/large-models.md; ``--record`` appends it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

SHAPES = {  # Qwen2.5's config.json values (hidden, intermediate, layers, heads, kv heads)
    "7B": (3584, 18944, 28, 28, 4),
    "32B": (5120, 27648, 64, 40, 8),
    "72B": (8192, 29568, 80, 64, 8),
}
COMMON = [
    "model.dtype=bfloat16",
    "model.gradient_checkpointing=true",
    "rollout.engine=vllm",
    "rollout.vllm_sleep_mode=true",
    "rollout.prompts_per_step=64",
    "rollout.group_size=8",
    "rollout.max_new_tokens=1024",
    "data.max_prompt_tokens=512",
    "train.micro_batch_samples_per_gpu=4",
    "train.logprob_micro_batch_samples_per_gpu=8",
    "train.max_tokens_per_micro_batch=6144",
    "kernels.logprob_chunk_tokens=1024",
]
LAYOUTS = [  # (model, what, overrides)
    (
        "7B",
        "ZeRO-3, vLLM tp 2",
        ["rollout.vllm_tensor_parallel_size=2", "rollout.vllm_gpu_memory_utilization=0.5"],
    ),
    (
        "32B",
        "ZeRO-3, vLLM tp 4",
        ["rollout.vllm_tensor_parallel_size=4", "rollout.vllm_gpu_memory_utilization=0.6"],
    ),
    (
        "32B",
        "ZeRO-3 + optimizer offload, vLLM tp 4",
        [
            "rollout.vllm_tensor_parallel_size=4",
            "rollout.vllm_gpu_memory_utilization=0.6",
            "deepspeed=ds_configs/zero3_offload_optimizer.json",
        ],
    ),
    (
        "72B",
        "ZeRO-3 + optimizer offload, vLLM tp 8",
        [
            "rollout.vllm_tensor_parallel_size=8",
            "rollout.vllm_gpu_memory_utilization=0.7",
            "deepspeed=ds_configs/zero3_offload_optimizer.json",
        ],
    ),
    (
        "72B",
        "ZeRO-3 + optimizer and parameter offload, vLLM tp 8",
        [
            "rollout.vllm_tensor_parallel_size=8",
            "rollout.vllm_gpu_memory_utilization=0.7",
            "deepspeed=ds_configs/zero3_offload.json",
        ],
    ),
]
BEGIN, END = (
    "<!-- large-models:begin (python benchmarks/large_model_estimates.py --update-docs) -->",
    "<!-- large-models:end -->",
)


def model_folder(root: Path, name: str) -> Path:
    from grpo_ds.model.tiny import build_tiny_tokenizer

    hidden, intermediate, layers, heads, kv = SHAPES[name]
    folder = root / f"qwen2.5-{name.lower()}-shape"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "hidden_size": hidden,
                "intermediate_size": intermediate,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "vocab_size": 152064,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
            }
        )
    )
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def check_output(folder: Path, overrides: list[str]) -> str:
    from grpo_ds import check

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check.main(
            [
                str(REPO / "recipes" / "tiny_cpu.json"),
                f"model.path={folder}",
                *COMMON,
                *overrides,
                "--world-size",
                "8",
                "--gpu-memory-gib",
                "80",
                "--lengths",
                "max",
            ]
        )
    return out.getvalue()


def gib(text: str, label: str) -> str:
    match = re.search(rf"^\s+{re.escape(label)}\s+([\d.]+) GiB", text, re.MULTILINE)
    return f"{float(match.group(1)):.1f}" if match else "-"


def main() -> None:
    from common import markdown_table, report

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="/tmp/grpo_ds_large_model_estimates")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    rows = []
    for name, what, overrides in LAYOUTS:
        text = check_output(model_folder(Path(args.workdir), name), overrides)
        params = re.search(r"\(([\d.]+) M parameters", text).group(1)
        fits = "yes" if re.search(r"fits in 80 GiB", text) else "no"
        advice = re.search(r"overrides that fit: (.*)", text)
        rows.append(
            [
                f"{name} ({float(params) / 1e3:.1f} B)",
                what,
                gib(text, "policy weights"),
                gib(text, "gradients"),
                gib(text, "peak on the device (the larger phase)"),
                gib(text, "host memory (offload)"),
                fits + (f"; fits with {advice.group(1)}" if advice else ""),
            ]
        )
        print(rows[-1], flush=True)
    headers = [
        "model",
        "layout (8 GPUs)",
        "weights GiB",
        "gradients GiB",
        "estimated peak GiB per GPU",
        "host GiB per rank",
        "in 80 GiB",
    ]
    body = markdown_table(headers, rows)
    if args.update_docs:
        page = REPO / "docs" / "guides" / "large-models.md"
        text = page.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        page.write_text(text[:start] + "\n" + body + "\n" + text[end:])
        print(f"{page.relative_to(REPO)} updated")
    report(
        "Large-model memory estimates (grpo_ds.check, not measured)",
        "8 x 80 GiB, bfloat16",
        "cpu",
        body,
        ["settings: " + " ".join(COMMON)],
        args.record,
    )


if __name__ == "__main__":
    main()
