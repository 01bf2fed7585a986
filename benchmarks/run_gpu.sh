#!/usr/bin/env bash
# Every benchmark at the GPU shapes, each table appended to benchmarks/RESULTS.md (--record). Installs nothing:
# it measures Liger-Kernel's fused linear GRPO loss only where liger_kernel is already importable.
#
#     bash benchmarks/run_gpu.sh
#
# 1. copy bandwidth and the logits-input kernel's achieved bandwidth (target >= 60% of copy), 16,384 x 151,936 bf16
# 2. log-prob + entropy + policy loss from logits, forward + backward, against eager PyTorch
# 3. fused linear policy loss, 16,384 tokens x hidden 4,096 x vocab 151,936 bf16, forward / backward / full,
#    against eager PyTorch (target >= 1.5x) and Liger (target >= 1.2x, peak memory <= Liger's)
# 4. masked policy loss on (B, T) and group advantages
# A benchmark that fails is reported at the end; the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."

python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'run_gpu.sh: no CUDA GPU visible to torch')" \
    || exit 1

failed=()
bench() {
    echo "== python $*"
    python "$@" || failed+=("python $*")
}

bench benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --tokens 16384 --vocab 151936 --op logprobs \
    --mode forward,backward,full --bandwidth --record
bench benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --tokens 16384 --vocab 151936 --op loss \
    --mode full --bandwidth --record
# Liger uncompiled: its torch.compile'd chunk loss failed on torch 2.11 (H200, 2026-11-26: dynamo's
# "AssertionError: sources must not be empty for symbol s37"), which ended the whole benchmark
bench benchmarks/bench_fused_linear.py --device cuda --dtype bfloat16 --tokens 16384 --seq-len 1024 --hidden 4096 \
    --vocab 151936 --chunk-tokens 1024 --mode forward,backward,full --liger-compiled 0 --record
bench benchmarks/bench_policy_loss.py --device cuda --batch 256 --seq-len 8192 --mode forward,backward,full --record
bench benchmarks/bench_advantages.py --device cuda --prompts 1024 --group-size 16 --record

if ((${#failed[@]})); then
    printf 'failed: %s\n' "${failed[@]}"
    exit 1
fi
echo "all benchmarks ran; tables appended to benchmarks/RESULTS.md"
