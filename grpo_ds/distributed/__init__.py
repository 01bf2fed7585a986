"""The job's ranks: the launcher's variables, DeepSpeed's accelerator choice and rank-0 output
(``launcher``, no torch), the process group with this process's place in it and the driver's
collectives (``ranks``), and split placement's process group between the trainer and the rollout
ranks (``bridge``), with the typed messages that cross it and their one versioned codec
(``messages``); its rollout side's receive and send in threads of their own, for continuous
generation (``mailbox``). Imports no other part of grpo_ds.
"""
