#!/usr/bin/env bash
# The one-shot GPU run (issue 38): install the carried wheels, then measure, most valuable first, every step under
# its own `timeout` and all of them inside one budget (default 480 s = 8 min). A step that fails or runs out of time
# is reported at the end; the others still run. Each benchmark appends its block to benchmarks/RESULTS.md (--record).
#
#     GRPO_DS_COMMIT=<commit the tree was copied from> bash benchmarks/run_gpu.sh
#
#   0. wheels: every .whl/*.whl (DeepSpeed 0.19.8 without prebuilt ops, trl, liger-kernel, datasets, pydantic, hjson,
#      ...: what the GPU image lacks) into /tmp/site, which goes on PYTHONPATH; no .whl/ folder: nothing installed
#   1. bench_vs_trl --device cuda at the 0.5B shape: grpo_ds (3 runs), grpo_ds in lean bf16 mode (train.lean_bf16,
#      1 run: its target is peak memory) and TRL (3 runs), 3 steps each; targets: step time <= 0.6x TRL's, lean peak
#      GPU memory <= TRL's
#   2. rollout: bench_rollout --device cuda at the 0.5B shape: the hf engine eager, compiled (rollout.hf_compile)
#      and plain generate
#   3. kernels = sweeps, kernels, policy_loss, support: the fused-linear and log-prob sweeps (block sizes, warps,
#      chunk tokens, the forward split into its parts; step "sweeps"), then bench_logprobs and bench_fused_linear with
#      the defaults (step "kernels"; targets: log-prob forward >= 60% of copy bandwidth; fused linear full >= 1.5x
#      eager; Liger compiled where it compiles, the block names which ran), then bench_policy_loss, then
#      bench_support (step "support": the log-prob pass over a top_k 20 + top_p 0.9 set against the untruncated one,
#      target <= 1.3x; the truncated kernels' tests run in step 4's tests/kernels)
#   4. pytest tests/kernels and every *_gpu.py test
#   lean (not in the default list): bench_vs_trl, lean bf16 mode with rollout.hf_compile=off (no static KV caches,
#      no CUDA-graph pool: 768 MiB of the 841 by which lean exceeded TRL on 2026-11-28) against TRL, 1 run each
# The steps run in the order RUN_GPU_STEPS names them.
#
# The steps' limits add up to about 18.5 minutes. Measured on an H200 on 2026-11-27: vs-TRL's fresh processes took
# ~72 s each (5 of its 7 runs fitted 360 s; compile and DeepSpeed's FusedAdam build included), and the rollout bench
# did not finish in 100 s; the sweeps ~1.5 min, the kernel benchmarks ~2 and the tests ~1.5 are estimates. With
# 15 minutes of device time a session, split it in two calls on the one warm machine (it stays warm for 30 s):
#     RUN_GPU_STEPS=1 RUN_GPU_BUDGET_S=520 VS_TRL_LIMIT_S=510 bash benchmarks/run_gpu.sh
#     RUN_GPU_STEPS="kernels 4 2 policy_loss sweeps" RUN_GPU_BUDGET_S=<what is left> bash benchmarks/run_gpu.sh
# (the wheels are installed again in the second, in seconds). The 2026-11-28 H200 session ran exactly that (462 s,
# then 350 s: kernels, 4 and policy_loss finished, the rollout bench did not). With the kernels' and tests' blocks
# on record, the next session's calls are better spent on what is still open, in this order (the truncated-support
# kernels and their tests have never run on a GPU):
#     RUN_GPU_STEPS="lean support 4 sweeps" RUN_GPU_BUDGET_S=520 bash benchmarks/run_gpu.sh
#     RUN_GPU_STEPS="kernels 2 policy_loss" RUN_GPU_BUDGET_S=<what is left> bash benchmarks/run_gpu.sh
#
# Environment: GRPO_DS_COMMIT (the commit named in every block; the copy's own .git may be another checkout's),
# VS_TRL_RUNS (runs per trainer, default 3), VS_TRL_LIMIT_S (default 540), HF_COMPILE (grpo_ds's
# rollout.hf_compile in vs-TRL, default on: the candidate default this run measures), HF_COMPILE_TIMEOUT_S (its
# rollout.hf_compile_timeout_s, default 150: a compile that stalls falls back to eager within that),
# RUN_GPU_BUDGET_S (total seconds, default 480), RUN_GPU_STEPS (which steps, in order, default "1 2 3 4"; also
# "sweeps", "kernels", "policy_loss", "support": the parts of step 3; "lean"), OUT (where the log,
# the new RESULTS.md blocks and the per-step logs go; default benchmarks/gpu_out). Under $OUT: run_gpu.log (all
# output), RESULTS.new.md (the blocks this run appended), summary.txt (one line a step), steps.tar.gz (per-step logs).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=${OUT:-$REPO/benchmarks/gpu_out}
mkdir -p "$OUT_DIR/steps"
BUDGET_S=${RUN_GPU_BUDGET_S:-480}
STEPS=${RUN_GPU_STEPS:-1 2 3 4}
BEGAN=$SECONDS
exec > >(tee -a "$OUT_DIR/run_gpu.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# grpo_ds from this tree: a benchmark script's own folder is on its sys.path, the repository root is not (the
# 2026-11-27 H200 run's sweeps died on 'No module named grpo_ds' without this)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

results_lines=$(wc -l < benchmarks/RESULTS.md)
summary=()
note() { summary+=("$1"); echo "== $1"; }
finish() {
    tail -n +"$((results_lines + 1))" benchmarks/RESULTS.md > "$OUT_DIR/RESULTS.new.md"
    {
        printf '%s\n' "${summary[@]}"
        echo "targets in the new blocks:"
        grep -E '^- .*(target|NOT met)' "$OUT_DIR/RESULTS.new.md" || echo "(none)"
    } > "$OUT_DIR/summary.txt"
    tar -czf "$OUT_DIR/steps.tar.gz" -C "$OUT_DIR" steps && rm -rf "$OUT_DIR/steps"
    echo "== run_gpu.sh: $((SECONDS - BEGAN)) s; summary:"
    cat "$OUT_DIR/summary.txt"
}
trap finish EXIT

# run NAME LIMIT_S COMMAND...: COMMAND under `timeout` (LIMIT_S, cut to what is left of the budget), its output in
# $OUT_DIR/steps/NAME.log and here; skipped when under 20 s are left
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - BEGAN)))
    if ((left < 20)); then
        note "$name: SKIPPED (${left} s of the ${BUDGET_S} s budget left)"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/steps/$name.log"
    local rc=${PIPESTATUS[0]}
    if ((rc == 0)); then
        note "$name: ok ($((SECONDS - t0)) s)"
    elif ((rc == 124 || rc == 137)); then
        note "$name: TIMED OUT after ${limit} s"
    else
        note "$name: FAILED (exit $rc, $((SECONDS - t0)) s): $(tail -n 1 "$OUT_DIR/steps/$name.log")"
    fi
}

# ---------------------------------------------------------------------------------------------- 0. wheels
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { note "wheels: FAILED to install .whl/*.whl"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    note "wheels: $(ls .whl | wc -l) installed into /tmp/site ($((SECONDS - BEGAN)) s)"
else
    note "wheels: no .whl/ folder, nothing installed"
fi
if [[ -z ${GRPO_DS_COMMIT:-} ]]; then
    note "GRPO_DS_COMMIT is not set: the blocks name this copy's git HEAD, which may be another checkout's"
fi
python3 - <<'EOF' || { note "environment: no CUDA GPU visible to torch, or a carried package does not import"; exit 1; }
import importlib, sys
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for name in ("deepspeed", "trl", "liger_kernel", "datasets", "triton", "transformers"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - reported, then the steps that need it fail on their own
        print(name, "NOT importable:", e, file=sys.stderr)
EOF

# ------------------------------------------------------------------- 1. grpo_ds vs TRL at the 0.5B shape
step_1() {
    # one run of each trainer took ~72 s on an H200 (2026-11-27): 3 runs each plus the lean run need ~8.5 minutes;
    # cut off by its limit, it still records the runs that had finished (bench_vs_trl's SIGTERM handling)
    run vs_trl "${VS_TRL_LIMIT_S:-540}" python3 benchmarks/bench_vs_trl.py --device cuda --shape qwen2-0.5b \
        --runs "${VS_TRL_RUNS:-3}" --steps 3 --set "rollout.hf_compile=${HF_COMPILE:-on}" \
        --set "rollout.hf_compile_timeout_s=${HF_COMPILE_TIMEOUT_S:-150}" --lean both --lean-runs 1 --record
}

# lean bf16 without compiled decoding against TRL: its static KV caches stay allocated through the update (the phase
# of the peak); ~2 runs of ~65 s
step_lean() {
    run vs_trl_lean 200 python3 benchmarks/bench_vs_trl.py --device cuda --shape qwen2-0.5b --runs 1 --steps 3 \
        --lean on --lean-set rollout.hf_compile=off --record
}

# ------------------------------------------------------------------------------------------ 2. rollout
# the hf engine's eager decode against its static-cache compiled one (rollout.hf_compile) and plain generate
step_2() {
    # ~2.5-3 minutes, mostly the compile (none has finished on a GPU yet: 100 s was too short on the H200)
    run rollout 200 python3 benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --shape qwen2-0.5b \
        --variants grpo_ds,compiled,generate --record
}

# ------------------------------------------------------------------------------------------ 3. kernels
step_sweeps() {
    # which block sizes, warps and chunk sizes to make the defaults
    run sweep_fused_linear 90 python3 benchmarks/bench_fused_linear.py --device cuda --dtype bfloat16 --tokens 16384 \
        --seq-len 1024 --hidden 4096 --vocab 151936 --sweep --record
    run sweep_logprobs 60 python3 benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --tokens 16384 \
        --vocab 151936 --sweep --record
}
step_kernels() {
    run bench_logprobs 45 python3 benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --tokens 16384 \
        --vocab 151936 --op logprobs --mode forward,backward,full --bandwidth --record
    # Liger compiled: its default torch.compile failed on torch 2.11 (2026-11-26, dynamo's "sources must not be
    # empty"); --liger-compiled 1 tries the default, then dynamic=False, then mode="max-autotune-no-cudagraphs", then
    # falls back to uncompiled, and the block's liger line names which ran
    # the Triton path only (the chunked torch path is the CPU's), 2 + 10 runs: uncompiled Liger takes ~1.1 s a call
    run bench_fused_linear 120 python3 benchmarks/bench_fused_linear.py --device cuda --dtype bfloat16 --tokens 16384 \
        --seq-len 1024 --hidden 4096 --vocab 151936 --chunk-tokens 1024 --mode forward,backward,full --backend triton \
        --warmup 2 --repeats 10 --liger-compiled 1 --record
}
step_policy_loss() {
    run bench_policy_loss 60 python3 benchmarks/bench_policy_loss.py --device cuda --batch 256 --seq-len 8192 \
        --mode forward,backward,full --record
}
# the log-prob pass over the sampler's top-k / top-p set against the untruncated one (issue "The trainer computes what
# the sampler sampled": its GPU figure), from logits and from hidden states, forward and full; ~1 minute
step_support() {
    run bench_support 90 python3 benchmarks/bench_support.py --device cuda --top-k 20 --top-p 0.9 --record
}
step_3() { step_sweeps; step_kernels; step_policy_loss; step_support; }

# ------------------------------------------------------------------------------------------ 4. GPU tests
step_4() {
    mapfile -t gpu_tests < <(find tests -name '*_gpu.py' | sort)
    run pytest_gpu 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 300 tests/kernels \
        "${gpu_tests[@]}"
}

for step in $STEPS; do
    if [[ $(type -t "step_$step") != function ]]; then
        note "$step: no such step (steps: 1 2 3 4 sweeps kernels policy_loss support lean)"
        continue
    fi
    "step_$step"
done

failed=$(printf '%s\n' "${summary[@]}" | grep -cE 'FAILED|TIMED OUT' || true)
((failed == 0))
