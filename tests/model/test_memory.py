"""The memory estimate (grpo_ds/model/memory.py) and grpo_ds.check's --gpu-memory-gib advice.

The estimate's model-state terms follow DeepSpeed's allocations, measured at 20 bytes per trained
parameter in float32 and 16 in bfloat16 under ZeRO-3 (benchmarks/bench_memory_estimate.py compares
whole runs with it)."""

import pytest

from grpo_ds import check
from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.model.memory import ModelShape, estimate
from grpo_ds.run.preflight import prepare_inputs
from grpo_ds.step import memory_fit
from tests.launch import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.json")
# a 7B-like shape: every parameter in the decoder's linear layers but the embeddings and the head
SHAPE = ModelShape(
    params=7_000_000_000,
    trainable=7_000_000_000,
    split=6_000_000_000,
    largest_layer=500_000_000,
    hidden=4096,
    layers=32,
    intermediate=11008,
    heads=32,
    kv_heads=32,
    vocab=32000,
)


def _estimate(world=8, shape=SHAPE, deepspeed="ds_configs/zero3.json", **sections):
    raw = {"deepspeed": deepspeed, **sections}
    recipe = load_recipe(raw)
    return estimate(
        recipe, shape, resolve_deepspeed_config(recipe, world, "cpu"), world, 4096, 1024, 32
    )


@pytest.mark.parametrize(("dtype", "bytes_per_param"), [("float32", 20), ("bfloat16", 16)])
def test_zero3_model_states_are_deepspeeds_bytes_per_parameter_over_dp(dtype, bytes_per_param):
    est = _estimate(model={"dtype": dtype})
    states = sum(
        est.device[k]
        for k in (
            "policy weights",
            "master weights (fp32)",
            "gradients",
            "Adam moments (fp32 m, v)",
        )
    )
    assert states == pytest.approx(SHAPE.params * bytes_per_param / 8, rel=1e-6)


def test_lean_bf16_keeps_the_master_and_the_moments_in_bf16():
    """Lean bf16 mode (train.lean_bf16): 2-byte master and moments, 10 bytes a parameter under
    ZeRO-3; at one rank the bf16 master is the weights themselves (share_fp32_master), 8 bytes:
    TRL's bf16 weights, gradients and AdamW moments. The optimizer step's temporaries are bf16
    too."""
    lean = _estimate(model={"dtype": "bfloat16"}, train={"lean_bf16": True})
    states = sum(
        lean.device[k]
        for k in (
            "policy weights",
            "master weights (bf16)",
            "gradients",
            "Adam moments (bf16 m, v)",
        )
    )
    assert states == pytest.approx(SHAPE.params * 10 / 8, rel=1e-6)
    one = _estimate(world=1, model={"dtype": "bfloat16"}, train={"lean_bf16": True})
    assert one.device["master weights (bf16): the bf16 weights themselves"] == 0
    assert one.device["policy weights"] + one.device["gradients"] + one.device[
        "Adam moments (bf16 m, v)"
    ] == pytest.approx(SHAPE.params * 8, rel=1e-6)
    default = _estimate(world=1, model={"dtype": "bfloat16"})
    assert default.device["master weights (fp32)"] == SHAPE.params * 4
    step = {k: v for k, v in one.phases.items() if k.startswith("optimizer step")}
    assert step == {
        "optimizer step (bf16 temporaries)": default.phases["optimizer step (fp32 temporaries)"]
        // 2
    }


def test_tensor_parallel_divides_the_split_layers_and_offload_moves_states_to_host():
    plain = _estimate(model={"dtype": "bfloat16"})
    tp = _estimate(model={"dtype": "bfloat16"}, train={"tensor_parallel_size": 2})
    # world 8 = dp 4 x tp 2: the split layers over 8 ranks as before, the replicated ones over 4
    # instead of 8
    replicated = SHAPE.params - SHAPE.split
    assert tp.device["policy weights"] - plain.device["policy weights"] == pytest.approx(
        replicated * 2 / 8, rel=1e-6
    )
    offload = _estimate(model={"dtype": "bfloat16"}, deepspeed="ds_configs/zero3_offload.json")
    assert set(offload.host) == {
        "policy weights",
        "master weights (fp32)",
        "Adam moments (fp32 m, v)",
    }
    assert offload.peak < plain.peak and offload.total == pytest.approx(plain.total, rel=0.05)


def test_the_reference_and_the_rollout_copy_are_counted_where_they_exist():
    est = _estimate(algorithm={"kl_coef": 0.1})
    assert est.device["reference model"] == est.device["policy weights"]
    # hf engine: whole on every rank
    assert est.device["rollout copy (unsharded)"] == SHAPE.params * 4
    vllm = _estimate(rollout={"engine": "vllm"})
    # vLLM loads its own weights (its share is its setting)
    assert "rollout copy (unsharded)" not in vllm.device
    one_rank = _estimate(world=1)  # stage 1: the hf engine generates with the policy's own module
    assert "rollout copy (unsharded)" not in one_rank.device
    assert (
        "rollout copy (unsharded)" in _estimate(world=1, train={"zero3_on_one_rank": True}).device
    )


def test_activation_checkpointing_and_the_fused_head_shrink_the_update_phase():
    def update(**sections):
        est = _estimate(**sections)
        return next(v for k, v in est.phases.items() if k.startswith("update"))

    assert update(model={"gradient_checkpointing": True}) < update() / 4
    assert update(kernels={"fused_lm_head": False}) > update()


def test_check_says_whether_it_fits_and_what_would_make_it_fit():
    # under ZeRO-3 (one rank otherwise runs stage 1, whose smaller peak fits 0.012 GiB by the
    # micro-batch alone) eager decoding (rollout.hf_compile's static caches, counted for a GPU,
    # would be the peak of this tiny model)
    zero3 = ["train.zero3_on_one_rank=true", "rollout.hf_compile=off"]
    inputs = prepare_inputs(TINY, zero3, 1, "cpu")
    assert "fits in 80 GiB" in check.report(inputs, 1, "max", 80)
    tight = check.report(inputs, 1, "max", 0.012)  # between the states alone and the full peak
    assert "does NOT fit in 0.012 GiB" in tight
    advice = tight.split("does NOT fit")[1].split("overrides that fit: ")
    steps = [line.strip() for line in advice[0].splitlines()[1:] if line.strip()]
    assert steps[0].split()[0] == "model.gradient_checkpointing=true"  # the playbook's first change
    assert steps[-1].endswith("fits") and not any(s.endswith("fits") for s in steps[:-1])
    overrides = advice[1].splitlines()[0].split()
    assert overrides[0] == "model.gradient_checkpointing=true"
    fixed = check.report(prepare_inputs(TINY, zero3 + overrides, 1, "cpu"), 1, "max", 0.012)
    assert "fits in 0.012 GiB" in fixed  # the advice, applied, fits
    hopeless = check.report(inputs, 1, "max", 0.0001)
    assert "nothing tried fits" in hopeless


def test_the_advice_turns_compiled_decoding_off_when_its_static_caches_are_the_peak():
    """For a GPU, rollout.hf_compile's static KV caches are held through the update, so once
    checkpointing and smaller micro-batches have done what they can, eager decoding (before a
    smaller generate call) is what makes this tiny model fit; the advice, applied, fits. Where the
    hf engine decodes eagerly or vLLM generates, it is not tried."""
    compiled = ["train.zero3_on_one_rank=true", "rollout.hf_compile=on"]
    advice = check.report(prepare_inputs(TINY, compiled, 1, "cpu"), 1, "max", 0.1).split(
        "does NOT fit"
    )[1]
    steps = [
        line.split()[0]
        for line in advice.split("overrides that fit: ")[0].splitlines()[1:]
        if line.strip()
    ]
    assert (
        steps[-1] == "rollout.hf_compile=off" and "rollout.generation_batch_prompts=12" not in steps
    )
    overrides = advice.split("overrides that fit: ")[1].splitlines()[0].split()
    # the micro-batches it tried first saved next to nothing
    assert overrides == ["rollout.hf_compile=off"]
    assert "fits in 0.1 GiB" in check.report(
        prepare_inputs(TINY, compiled + overrides, 1, "cpu"), 1, "max", 0.1
    )
    for recipe in (
        load_recipe(TINY, ["rollout.hf_compile=off"]),
        load_recipe(TINY, ["rollout.engine=vllm"]),
    ):
        assert "compile" not in {knob for knob, _, _ in memory_fit._changes(recipe, 1)}


def test_the_advice_shrinks_the_generate_call_when_its_kv_cache_is_the_peak():
    """Long completions: once checkpointing and smaller micro-batches have shrunk the update, the hf
    engine's KV cache is the peak, and only fewer prompts per generate call (then, in a second pass,
    smaller micro-batches again) make it fit; the advice, applied, fits."""
    # eager: one generate call's KV cache
    long = ["rollout.max_new_tokens=500", "rollout.hf_compile=off"]
    inputs = prepare_inputs(TINY, long, 1, "cpu")
    advice = check.report(inputs, 1, "max", 0.1).split("does NOT fit")[1]
    steps = [
        line.split()[0]
        for line in advice.split("overrides that fit: ")[0].splitlines()[1:]
        if line.strip()
    ]
    # 25 prompts per rank, halved
    first_generation = steps.index("rollout.generation_batch_prompts=12")
    assert steps[first_generation + 1 :].count("rollout.generation_batch_prompts=12") == 0
    # 2nd pass
    assert any(
        s.startswith("train.micro_batch_samples_per_gpu=") for s in steps[first_generation + 1 :]
    )
    overrides = advice.split("overrides that fit: ")[1].splitlines()[0].split()
    assert any(o.startswith("rollout.generation_batch_prompts=") for o in overrides)
    assert "fits in 0.1 GiB" in check.report(
        prepare_inputs(TINY, long + overrides, 1, "cpu"), 1, "max", 0.1
    )
    vllm = load_recipe(TINY, [*long, "rollout.engine=vllm"])
    # vLLM sizes its own KV cache
    assert "generation" not in {knob for knob, _, _ in memory_fit._changes(vllm, 1)}


def test_compiled_decoding_keeps_its_static_caches_between_steps():
    """rollout.hf_compile (auto: on a GPU, --gpu-memory-gib's machine): its caches, one per distinct
    generate-call size, count among the states the device always holds, as long as the widest prompt
    plus max_new_tokens rounded up to 256 positions (transformers' StaticCache: layers x 2 x (rows,
    kv heads, length, head dim), checked against a real one in tests/rollout/test_hf_compile.py);
    the generation phase then adds only its scores."""
    qwen = ModelShape(
        params=494_032_768,
        trainable=494_032_768,
        split=357_000_000,
        largest_layer=136_134_656,
        hidden=896,
        layers=24,
        intermediate=4864,
        heads=14,
        kv_heads=2,
        vocab=151_936,
    )
    sections = [
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        "rollout.max_new_tokens=256",
        "model.dtype=bfloat16",
        "train.micro_batch_samples_per_gpu=16",
    ]
    lengths = [20 + 256] * 128  # prompts of up to 20 tokens, completions at the limit
    inputs = prepare_inputs(TINY, sections, 1, "cpu")
    on_gpu = check.estimate_memory(
        inputs.recipe, qwen, inputs.ds_config, 1, lengths, gpu_memory_gib=141
    )
    # bench_vs_trl's 0.5 B shape on the H200 (2026-11-28): 16 x 8 rows x 512 positions x 24 layers x
    # 2 x 2 x 64 x 2 B
    assert (
        on_gpu.device["static KV caches (rollout.hf_compile)"]
        == 128 * 512 * 24 * 2 * 2 * 64 * 2
        == 768 * 2**20
    )
    assert "generation (scores; the KV cache is the static one)" in on_gpu.phases
    # auto: eager on a CPU
    on_cpu = check.estimate_memory(inputs.recipe, qwen, inputs.ds_config, 1, lengths)
    assert "static KV caches (rollout.hf_compile)" not in on_cpu.device
    assert "generation (KV cache, scores)" in on_cpu.phases
    off = prepare_inputs(TINY, [*sections, "rollout.hf_compile=off"], 1, "cpu")
    assert (
        "static KV caches (rollout.hf_compile)"
        not in check.estimate_memory(
            off.recipe, qwen, off.ds_config, 1, lengths, gpu_memory_gib=141
        ).device
    )
    # 100 prompts a rank in calls of 64: two cache sizes, 64 and 36 prompts' rows
    uneven = prepare_inputs(
        TINY, ["rollout.prompts_per_step=100", "rollout.hf_compile=on"], 1, "cpu"
    )
    assert memory_fit.static_cache(uneven.recipe, 1, 300, None) == (
        100 * uneven.recipe.rollout.group_size,
        512,
    )
