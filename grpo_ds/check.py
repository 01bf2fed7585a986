"""Dry run: validate a recipe for a world size and print the batch plan, without loading a model.

    python -m grpo_ds.check RECIPE.json --world-size 8 [section.key=value ...]

The validation is grpo_ds.inputs.prepare_inputs, the same one ``grpo_ds.train`` runs first; this module is the
report only.
"""

from __future__ import annotations

import argparse

import numpy as np

from grpo_ds import lora
from grpo_ds.ds_config import load_deepspeed_json
from grpo_ds.engine import device_type
from grpo_ds.errors import exit_on_user_error
from grpo_ds.inputs import Inputs, prepare_inputs
from grpo_ds.planner import old_logprob_pass_reason, plan_recipe_step, token_imbalance
from grpo_ds.recipe import Recipe


def simulated_lengths(inputs: Inputs, mode: str) -> list[int]:
    """Sequence lengths (prompt + completion) for one step: real prompt lengths from the dataset, completions
    uniform in [1, the response limit] ("uniform") or all at the limit ("max"); the limit is max_new_tokens, or an
    agent's max_total_tokens."""
    recipe = inputs.recipe
    rng = np.random.default_rng(recipe.run.seed)
    prompt_lengths = [len(p.prompt_ids) for p in inputs.prompts]
    out = []
    for _ in range(recipe.rollout.prompts_per_step):
        prompt = prompt_lengths[int(rng.integers(len(prompt_lengths)))]
        for _ in range(recipe.rollout.group_size):
            top = recipe.max_response_tokens
            new = top if mode == "max" else int(rng.integers(1, top + 1))
            out.append(prompt + new)
    return out


def parameter_counts(recipe: Recipe, vocab_size: int) -> tuple[int, int]:
    """(all, trainable) parameters, exact, from the model config built on the meta device (no weights, no memory);
    with model.lora_rank the trainable ones are the adapters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_ds.builtin_tiny import build_tiny_model
    from grpo_ds.models import BUILTIN_TINY

    m = recipe.model
    with torch.device("meta"):
        if m.path == BUILTIN_TINY:
            model = build_tiny_model(vocab_size, m.tiny_hidden_size, m.tiny_num_layers, m.tiny_num_heads)
        else:
            config = AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
        if lora.enabled(m):
            model = lora.apply_lora(model, m)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def memory_estimate_gib(recipe: Recipe, params: int, trainable: int, world_size: int) -> dict[str, float]:
    """Per-GPU bytes of model states under ZeRO-3 (activations not included); gradients and optimizer states
    exist for the trainable parameters only (a LoRA run: the adapters)."""
    width = 4 if recipe.model.dtype == "float32" else 2
    master = 0 if width == 4 else 4  # fp32 master copy in mixed precision
    gib = 2**30
    lora_run = lora.enabled(recipe.model)
    what = "weights (base + adapters)" if lora_run else "weights"
    base = params - trainable if lora_run else params  # the rollout engine holds the plain (merged) model
    out = {f"policy {what} (sharded)": params * width / world_size / gib,
           "gradients (sharded)": trainable * width / world_size / gib,
           "optimizer states (sharded, fp32 Adam m, v" + (", master" if master else "") + ")":
               trainable * (8 + master) / world_size / gib,
           "rollout copy (hf engine, unsharded)": base * width / gib}
    if recipe.algorithm.kl_coef > 0 and not lora_run:  # LoRA: the reference is the base, adapters disabled
        out["reference model (sharded)"] = params * width / world_size / gib
    return out


def report(inputs: Inputs, world_size: int, lengths_mode: str) -> str:
    r = inputs.recipe
    lengths = simulated_lengths(inputs, lengths_mode)
    t = r.train
    tp = t.tensor_parallel_size
    dp = world_size // tp
    plan = plan_recipe_step(r, lengths, dp, step=1)
    ds = inputs.ds_config
    _, ds_where = load_deepspeed_json(r)
    first = plan.minibatches[0]
    micro_rule = f"<= {t.max_tokens_per_micro_batch} padded tokens (dynamic)" if t.max_tokens_per_micro_batch \
        else f"{t.micro_batch_samples_per_gpu} samples"
    lp_rule = f"<= {t.max_tokens_per_micro_batch} padded tokens (dynamic)" if t.max_tokens_per_micro_batch \
        else f"{t.logprob_micro_batch_samples_per_gpu} samples"
    lines = [
        f"recipe is valid for world size {world_size}",
        f"parallel layout: world size {world_size} = data parallel {dp} x tensor parallel {tp}"
        + (f" (ranks {tp}d .. {tp}d+{tp - 1} form tensor-parallel group d and run the same samples)" if tp > 1
           else ""),
        "",
        "batch algebra",
        f"  samples per step             {r.samples_per_step} = prompts_per_step {r.rollout.prompts_per_step}"
        f" x group_size {r.rollout.group_size}",
        f"  samples per optimizer step   {r.samples_per_optimizer_step}",
        f"  optimizer steps per rollout  {r.optimizer_steps_per_rollout} = {r.samples_per_step} / "
        f"{r.samples_per_optimizer_step} x epochs_per_rollout {t.epochs_per_rollout}",
        f"  update micro-batch           {micro_rule} per GPU",
        f"  log-prob micro-batch         {lp_rule} per GPU",
        "  old-log-prob pass            " + (f"runs ({reason})" if (reason := old_logprob_pass_reason(r))
                                             else "skipped (one optimizer step per rollout: old = current)"),
        "  reference log-prob pass      " + (f"runs (kl_coef {r.algorithm.kl_coef})" if r.algorithm.kl_coef > 0
                                             else "off (kl_coef 0)"),
        "",
        f"per-rank shards of optimizer step 1 (simulated lengths: {lengths_mode}; prompt lengths from the data"
        + ("; one line per data-parallel rank" if tp > 1 else "") + ")",
    ]
    for rank, micro in enumerate(first.micro_batches):
        ids = [s for mb in micro for s in mb]
        padding = sum(1 for mb in micro if not mb)
        lines.append(f"  rank {rank:>3}: {len(ids):>5} samples {sum(lengths[s] for s in ids):>8} tokens  "
                     f"{len(micro)} update micro-batches ({padding} padding)  "
                     f"{len(plan.logprob_pass.micro_batches[rank])} log-prob micro-batches")
    lines += [f"  token imbalance (max/mean over ranks): {token_imbalance(first, lengths):.3f}", "",
              f"DeepSpeed (resolved from {ds_where})",
              f"  train_micro_batch_size_per_gpu  {ds['train_micro_batch_size_per_gpu']}",
              f"  gradient_accumulation_steps     {ds['gradient_accumulation_steps']} (static plan; grpo_ds owns the "
              f"step boundary, so padding and dynamic batches need no change here)",
              f"  train_batch_size                {ds['train_batch_size']} = {ds['train_micro_batch_size_per_gpu']}"
              f" x {ds['gradient_accumulation_steps']} x world size {world_size}" if "train_batch_size" in ds else
              "  train_batch_size                left out (AutoTP under ZeRO-3: DeepSpeed checks it against two sizes)",
              f"  zero stage                      {ds.get('zero_optimization', {}).get('stage', 0)}", "",
              f"kernels: {inputs.kernels_backend} backend (kernels.backend {r.kernels.backend!r}), "
              + ("full logits, " if not r.kernels.fused_lm_head else "fused lm_head (no full logits), " if tp == 1
                 else "full logits (tensor parallelism splits the lm_head), ")
              + f"{r.kernels.logprob_chunk_tokens} tokens per chunk"]
    params, trainable = parameter_counts(r, len(inputs.tokenizer))
    trained = f", {trainable / 1e6:.2f} M trainable (LoRA rank {r.model.lora_rank})" if lora.enabled(r.model) else ""
    lines += ["", f"memory estimate per GPU (model states only; {params / 1e6:.2f} M parameters{trained}, "
                  f"{r.model.dtype})"]
    for name, value in memory_estimate_gib(r, params, trainable, world_size).items():
        lines.append(f"  {name:<52} {value:8.3f} GiB")
    lines.append(f"dataset: {len(inputs.prompts)} prompts ({inputs.skipped_rows} bad rows skipped)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="grpo_ds.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="path to a recipe JSON file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs) to plan for")
    parser.add_argument("--lengths", choices=("uniform", "max"), default="uniform",
                        help="completion lengths to simulate: uniform in [1, max_new_tokens], or all at the maximum")
    args = parser.parse_intermixed_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    with exit_on_user_error():
        inputs = prepare_inputs(args.recipe, args.overrides, args.world_size, device_type())
        print(report(inputs, args.world_size, args.lengths))


if __name__ == "__main__":
    main()
