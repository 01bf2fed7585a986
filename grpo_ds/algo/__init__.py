"""The reference math, one implementation of each formula, each with its paper: group advantages
(``advantages``), log-probs and entropy (``logprobs``), the sampler's top-k / top-p set they are
taken over (``truncation``), KL estimators (``kl``), the clipped and GSPO policy losses
(``policy_loss``), loss aggregation (``aggregation``), importance weights (``importance``), reward
shaping (``shaping``), an MoE router's load-balancing loss (``router``), and the names a recipe
chooses among (``names``, which imports nothing). Tests, the kernels' fallbacks and the benchmarks
all compare against these. Rule (tests/test_layout.py): imports nothing of grpo_ds outside algo.
"""
