"""Configuration: what a run is given, checked before anything loads.

The recipe schema (``recipe``, which knows nothing of loading, with its rollout and reward sections
in ``recipe_rollout`` and its algorithm, train and kernels sections in ``recipe_training``; each key
declared with ``options``' opt), loading a recipe into it and then checking its cross-key rules
(``loading``, with the rules in ``rules``), the JSON and override parsing (``parse``), the reward
entries as values (``reward_specs``), the generated key reference (``reference``), the DeepSpeed
config resolved from the recipe (``deepspeed``) and checked as DeepSpeed would (``deepspeed_check``,
with the plain reads in ``deepspeed_keys``), the dtype names (``dtypes``), which ranks train and
which generate (``placement``), and the installed software (``software``: versions, known-bad
combinations, the kernels backend). Rule (tests/test_layout.py): nothing here imports torch, and
nothing here imports another part of grpo_ds except the names of the formulas (grpo_ds.algo.names),
the launcher's variables and errors; no circle, annotations included.
"""
