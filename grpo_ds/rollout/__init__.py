"""Rollout engines: one protocol (``base``: generate and update_weights, and the turn sampler of
multi-turn episodes) and three engines: transformers' generate (``hf``, with ``hf_compile``: its
static-cache, compiled decode step and the watchdog that falls back to eager; ``hf_sampling``: the
warpers, token picking and padding its decode loops share; ``hf_continuous``: the running batch of
continuous generation, refilled between decode steps and taking new weights between them),
multi-turn episodes with an environment (``agent``) and vLLM (``vllm``, imported only when chosen;
with ``rollout.vllm_sleep_mode`` it sleeps and wakes its own GPU memory around each generate, which
the protocol does not ask of the others). What a vLLM run checks before any model loads, and what
the engine asks the installed vLLM (``vllm_checks``), the recipe's settings and vLLM's outputs
translated (``vllm_requests``), and the removal of the /dev/shm segments its CPU tensor parallelism
leaves behind (``vllm_shm``), and vLLM's own continuous batching fed group by group for continuous
generation (``vllm_continuous``); one stop set for all engines (``stop``); random numbers keyed by
sample, so that a sample does not depend on the batch it was drawn in (``streams``). Rule
(tests/test_layout.py): an engine knows environments, the recipe's values and the ranks, never the
model's training side, the step or the run.
"""
