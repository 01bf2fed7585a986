"""The model being trained: loading it (``loading``, the builtin tiny model in ``tiny``), its
DeepSpeed engines (``engine``), the policy that owns them and decides full fine-tuning or LoRA once
(``policy``, ``lora``), Ulysses sequence parallelism on its attention (``sequence_parallel``), its
weights gathered out of ZeRO-3 shards for the rollout engine and the final save (``weight_gather``),
the model rebuilt from a checkpoint for the export (``rebuild``), the per-rank memory estimate
(``memory``) from the models' shapes (``shape``), the checks of reward model folders before
anything loads (``reward_model_checks``), weight files checked from their headers
(``weight_files``), and sequences cut into micro-batches by a sample count or a token budget
(``batching``: the step's planner and the reward models' scorer share it).
Rule (tests/test_layout.py): nothing here imports the step, the run or the CLIs.
"""
