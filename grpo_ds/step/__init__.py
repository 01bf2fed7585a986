"""The phases of one training step, in the order grpo_ds/train.py runs them: collect rollouts and
rewards (``collect``), plan optimizer steps and micro-batches (``plan``), build the flat
micro-batches (``micro_batch``), the log-prob passes and the policy update (``update``) through one
micro-batch's loss (``loss``), the advantages between them (``advantage``) and the NaN guard over
the optimizer steps (``guard``); then the step's metrics and logs (``report``) and its checkpoint,
the stop after a preemption signal and the run's final weights (``save``). The step's data travels
in one ``StepBatch`` (``batch``); what every phase reads (the settings, the rank layout, the
engines, the logger) in one ``StepContext`` (``context``). Which ranks run which phase, and when
(colocated, or split into trainer and rollout ranks), is the step's ``schedule``; under continuous
generation the rollout ranks' side of it is ``continuous``. Evaluation
(``evaluate``), per-phase timing and traces (``profiling``) and the memory sampled through the
profiled steps (``memory_timeline``) run beside them. For the dry run (grpo_ds.check), a rank's
memory over the first planned step and the overrides that would make it fit a GPU
(``memory_fit``). Rule (tests/test_layout.py): nothing here imports the CLIs; the model is passed
in, not built here.
"""
