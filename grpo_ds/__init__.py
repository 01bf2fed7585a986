"""grpo_ds: GRPO-family RL post-training of language models on DeepSpeed ZeRO-3.

The public surface is what this module lists; everything else is internal and may move between
releases.

    grpo_ds.train(recipe, overrides=None) -> list[dict]   run a recipe here, return one metrics dict
                                                          per step
    grpo_ds.Recipe, grpo_ds.load_recipe                   the recipe schema, and loading one (path
                                                          or dict + overrides)
    grpo_ds.UserError                                     the one-line error every bad input raises
    grpo_ds.RewardFn, grpo_ds.RewardError                 the reward-function protocol, and a
                                                          per-sample failure
    grpo_ds.Environment, grpo_ds.StepResult, grpo_ds.EnvFactory
                                                          the multi-turn environment protocol

The command lines are ``python -m grpo_ds.train | launch | check | export | plot``
(``python -m grpo_ds.launch --num_gpus N --module grpo_ds.train``: DeepSpeed's launcher, with stops
that wait for the ranks).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it. Imported on first use: `import grpo_ds` stays light (no torch,
# no DeepSpeed).
_PUBLIC = {
    "Recipe": "grpo_ds.config.recipe",
    "load_recipe": "grpo_ds.config.loading",
    "UserError": "grpo_ds.errors",
    "RewardFn": "grpo_ds.rewards.loading",
    "RewardError": "grpo_ds.rewards.item_error",
    "Environment": "grpo_ds.envs.base",
    "StepResult": "grpo_ds.envs.base",
    "EnvFactory": "grpo_ds.envs.base",
}
__all__ = ["train", *_PUBLIC]


def __getattr__(name: str):
    if name == "train":  # the driver module, callable: grpo_ds.train("recipe.json")
        return importlib.import_module("grpo_ds.train")
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'grpo_ds' has no attribute {name!r}")
