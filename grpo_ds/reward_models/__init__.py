"""Learned reward models: sequence-classification models with one label that score a prompt and its
completion.

``render`` turns each prompt + completion into the reward model's own tokens (its chat template, its
tokenizer: the policy's token ids never reach it), ``scorer`` loads the models like the reference
model (partitioned under ZeRO-3, no optimizer) and scores every rank's share of a step's samples in
token micro-batches, gathered on every rank (``RewardModels.score_models``), and ``tiny`` builds
small reward models and tokenizers in code (a random one, and a hand-set one whose score rises with
the share of one digit) for tests and CPU recipes. Their folders are checked before anything loads
by grpo_ds.model.reward_model_checks (the preflight imports it). Rule (tests/test_layout.py):
nothing here imports the step or the run; the step's phases hold a ``RewardModels``.
"""
