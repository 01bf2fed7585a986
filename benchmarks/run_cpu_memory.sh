#!/usr/bin/env bash
# Peak memory on the CPU at 4,096 tokens x vocab 151,936 (fp32), each variant in a fresh process, one at a time
# (the eager variant needs about 15 GB), tables appended to benchmarks/RESULTS.md. About 10 minutes on 2 cores.
#
#     bash benchmarks/run_cpu_memory.sh
#
# 1. log-prob + entropy + policy loss from fp32 logits, forward + backward: chunked extra memory vs eager's
#    (target: at most a quarter), at three chunk sizes
# 2. the same loss from hidden states (hidden 896) and the lm_head weight: what the fused-linear path holds
#    beyond the gradients, in chunks of logits, against the full logits
set -euo pipefail
cd "$(dirname "$0")/.."

python benchmarks/bench_logprobs.py --device cpu --tokens 4096 --vocab 151936 --op loss --mode full \
    --memory --chunk-tokens 1024,512,256 --record
python benchmarks/bench_fused_linear.py --device cpu --tokens 4096 --seq-len 1024 --hidden 896 --vocab 151936 \
    --mode full --memory --chunk-tokens 1024,512 --record
