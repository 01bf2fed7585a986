"""grpo_ds: GRPO-family RL post-training on DeepSpeed ZeRO-3.

``grpo_ds.train("recipe.json", overrides={...})`` runs a recipe from Python and returns its metrics;
``python -m grpo_ds.train`` and ``deepspeed --module grpo_ds.train`` are the same run from the shell.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import grpo_ds` stays light (no torch/DeepSpeed) until training is asked for.
    if name == "train":
        import importlib

        return importlib.import_module("grpo_ds.train")
    raise AttributeError(f"module 'grpo_ds' has no attribute {name!r}")
