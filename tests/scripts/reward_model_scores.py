"""Reward models scored by grpo_ds.reward_models.scorer in four variants (packing x offload), in one
process; launched by `deepspeed` at world sizes 2 and 3 (tests/reward_models/test_scorer.py), and
imported by the same test at world size 1.

    deepspeed --num_gpus N tests/scripts/reward_model_scores.py OUT_DIR RM_FOLDER

Every rank writes OUT_DIR/rank<r>.json: per variant, every model's scores of the whole batch (as
this rank holds them after the gather), the step's metrics, and how the engine holds the weights
(ZeRO stage, parameter offload).
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.distributed.ranks import Dist, end_launched_rank, init_distributed
from grpo_ds.reward_models.scorer import RewardModels

# Seven samples (uneven shares at 2 and 3 ranks), short and long: at MICRO_TOKENS some share a
# micro-batch, some are longer than the budget (a micro-batch of their own), and ranks get different
# numbers of micro-batches.
SAMPLES = [
    ("What is 3 + 4?", "7"),
    ("Count to five.", "1 2 3 4 5, and that is all of them: one, two, three, four, five."),
    ("Say nothing.", ""),
    ("Name a colour.", "Blue."),
    (
        "Write a long line of sevens, please, as many as you can fit in the answer.",
        "7777777 77 777777777 7777 77777",
    ),
    ("hi", "hello there, how are you today?"),
    ("Spell cat.", "c-a-t"),
]
MICRO_TOKENS = 64
VARIANTS = [
    ("packed", True, False),
    ("padded", False, False),
    ("packed_offload", True, True),
    ("padded_offload", False, True),
]
SHORT = 24  # max_length of the truncating model: most rendered samples are longer


def specs(folder: str, offload: bool) -> list[RewardModelSpec]:
    """Three models from one folder: with its chat template and a normalisation, on the plain text,
    truncated."""
    return [
        RewardModelSpec(path=folder, name="chat", mean=0.5, std=2.0, offload=offload),
        RewardModelSpec(path=folder, name="plain", chat_template=False, offload=offload),
        RewardModelSpec(
            path=folder, name="short", chat_template=False, max_length=SHORT, offload=offload
        ),
    ]


def ds_config(world_size: int, zero3: bool) -> dict:
    recipe = load_recipe({"train": {"zero3_on_one_rank": zero3}})
    return resolve_deepspeed_config(recipe, world_size, "cpu")


def score_variants(folder: str, dist: Dist, zero3: bool = True) -> dict:
    """{variant: {"scores": {name: [...]}, "metrics": {...}, "stage": int, "param_offload": bool,
    "on_cpu": bool}}"""
    cfg = ds_config(dist.world_size, zero3)
    prompts, completions = [p for p, _ in SAMPLES], [c for _, c in SAMPLES]
    out = {}
    for name, packing, offload in VARIANTS:
        models = RewardModels.build(
            specs(folder, offload), cfg, dist, MICRO_TOKENS, packing=packing
        )
        scored = models.score_models(prompts, completions, dist)
        engine = models.models[0].engine
        out[name] = {
            "scores": scored.scores,
            "metrics": scored.metrics,
            "stage": engine.zero_optimization_stage(),
            "param_offload": bool(engine.zero_offload_param()),
            "on_cpu": all(p.device.type == "cpu" for p in engine.module.parameters()),
            "packing_problem": [m.packing_problem for m in models.models],
        }
    # sequence parallelism: both ranks form one group and score the same (whole) batch
    if dist.world_size == 2:
        sp = replace(dist, sp_size=2)
        models = RewardModels.build(specs(folder, False), cfg, sp, MICRO_TOKENS, packing=True)
        scored = models.score_models(prompts, completions, sp)
        out["packed_sp2"] = {"scores": scored.scores, "metrics": scored.metrics}
    return out


def main(out_dir: str, folder: str) -> None:
    dist = init_distributed()
    result = score_variants(folder, dist)
    (Path(out_dir) / f"rank{dist.rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(*args)
    # past the teardown that sometimes aborts a finished rank (grpo_ds.distributed.ranks)
    end_launched_rank(0)
