"""Run ONE optimizer step on fixed rollouts and save the full parameters (launched by `deepspeed`).

Used by tests/step/test_update.py to check the loss contract: the parameters after one step must not
depend on world size, micro-batch size, dynamic batching or padding. AdamW is given eps = lr = 1e4,
so its first update is lr * g / (|g| + eps) ~= g: a plain gradient step, sensitive to the gradient's
scale (with a small eps, Adam's first step is ~lr * sign(g) and would hide a normalisation error).

    deepspeed --num_gpus W tests/scripts/one_step.py OUT_DIR CONFIGS_JSON
CONFIGS_JSON: list of {"loss_agg": ..., "micro": int, "max_tokens": int | null, optional
"fused_lm_head": bool, "backend": "torch" | "triton", "tp": int (tensor-parallel size, AutoTP),
"stage": int (ZeRO stage, default 3), "packing": bool (default true), "attn": "sdpa" | "eager",
"sp": int (sequence-parallel size, Ulysses), "experts": int (the tiny model as a mixture of that
many experts, top-2: grpo_ds.model.tiny), "router_aux": float (model.router_aux_loss_coef),
"sampling": {"temperature", "top_k", "top_p"} (the rollout's: log-probs and the update are over the
sampler's truncated set, grpo_ds.algo.truncation)}; one file OUT_DIR/<i>.pt each with the parameters
after the step and every sample's log-probs before it (a mixture of experts: also "routing", per
rank the experts each forward's tokens went to, per layer). Without a GPU the Triton backend runs
through Triton's interpreter.
"""

import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import end_launched_rank, init_distributed
from grpo_ds.model import sequence_parallel
from grpo_ds.model.engine import create_train_engine
from grpo_ds.model.policy import fused_lm_head_problem
from grpo_ds.model.tiny import build_tiny_model
from grpo_ds.model.weight_gather import gathered_named_parameters
from grpo_ds.rollout.base import Rollouts
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.plan import StepPlan, plan_minibatch
from grpo_ds.step.update import UpdateSettings, logprob_pass, optimizer_step

VOCAB = 64


def fixed_rollouts(num_samples: int = 9, seed: int = 0) -> tuple[Rollouts, list[float]]:
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(3, 7, (num_samples,), generator=g).tolist()
    response_len = torch.randint(1, 13, (num_samples,), generator=g).tolist()
    prompts = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in prompt_len]
    responses = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in response_len]
    advantages = torch.randn(num_samples, generator=g).tolist()
    return Rollouts(
        prompts, responses, [[0.0] * n for n in response_len], ["length"] * num_samples
    ), advantages


def record_routing(model) -> list[list[set[int]]]:
    """[forward][layer] the experts this rank's tokens were routed to, filled as the model runs
    (every router of transformers' MoE models returns (logits, weights, expert indices))."""
    forwards: list[list[set[int]]] = []
    routers = [layer.mlp.gate for layer in model.model.layers]

    def hook(module, _inputs, output):
        if module is routers[0]:
            forwards.append([])
        forwards[-1].append(set(output[2].reshape(-1).tolist()))

    for router in routers:
        router.register_forward_hook(hook)
    return forwards


def main(out_dir: str, configs: list[dict]) -> None:
    rollouts, advantages = fixed_rollouts()
    pairs = zip(rollouts.prompt_ids, rollouts.response_ids, strict=True)
    tokens = {i: len(p) + len(r) for i, (p, r) in enumerate(pairs)}
    for index, cfg in enumerate(configs):
        dist = init_distributed(cfg.get("tp", 1), cfg.get("sp", 1))
        recipe = load_recipe(
            {
                "model": {"router_aux_loss_coef": cfg.get("router_aux", 0.0)},
                "rollout": {
                    "prompts_per_step": 3,
                    "group_size": 3,
                    "max_new_tokens": 12,
                    **cfg.get("sampling", {}),
                },
                "data": {"max_prompt_tokens": 6},
                "algorithm": {"loss_agg": cfg["loss_agg"]},
                "kernels": {
                    "fused_lm_head": cfg.get("fused_lm_head", True),
                    "logprob_chunk_tokens": 16,
                },
                "train": {
                    "micro_batch_samples_per_gpu": cfg["micro"],
                    "max_tokens_per_micro_batch": cfg["max_tokens"],
                    "lr": 1e4,
                    "max_grad_norm": 0.0,
                    "tensor_parallel_size": cfg.get("tp", 1),
                    "packing": cfg.get("packing", True),
                    "sequence_parallel_size": cfg.get("sp", 1),
                },
                "deepspeed": {
                    "zero_optimization": {"stage": cfg.get("stage", 3)},
                    "optimizer": {"params": {"eps": 1e4}},
                },
            }
        )
        model = build_tiny_model(
            VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            seed=0,
            num_experts=cfg.get("experts", 0),
        )
        model.set_attn_implementation(cfg.get("attn", "sdpa"))
        routing = record_routing(model) if cfg.get("experts") else None
        mpu = (
            sequence_parallel.register(model, dist.sp_size, recipe.sequence_parallel_rows)
            if dist.sp_size > 1
            else None
        )
        engine = create_train_engine(
            model, resolve_deepspeed_config(recipe, dist.world_size, "cpu"), mpu
        )
        plan = plan_minibatch(
            list(tokens),
            tokens,
            dist.dp_size,
            max_samples=cfg["micro"],
            max_tokens=cfg["max_tokens"],
            packed=recipe.train.packing,
        )
        settings = UpdateSettings.from_recipe(
            recipe,
            pad_id=0,
            backend=cfg.get("backend", "torch"),
            fused_lm_head_allowed=fused_lm_head_problem(engine.module) is None,
        )
        data = StepBatch(
            [], rollouts, [], advantages=advantages, plan=StepPlan((plan,), plan, False)
        )
        logprobs = logprob_pass(engine, data, settings, dist)
        optimizer_step(engine, data, plan, settings, dist)
        params = {
            name: t.detach().clone() for name, t in gathered_named_parameters(engine.module, 2**20)
        }
        routes = dist.all_gather(routing) if routing is not None else None
        if dist.is_main:
            torch.save(
                {
                    "params": params,
                    "logprobs": logprobs,
                    "micro_batches": plan.micro_batches,
                    "padding": plan.padding_micro_batches(),
                    "routing": routes,
                },
                Path(out_dir) / f"{index}.pt",
            )
        del engine
        sequence_parallel.restore()
    dist.barrier()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], json.loads(args[1]))
    # past the teardown that sometimes aborts a finished rank (grpo_ds.distributed.ranks)
    end_launched_rank(0)
