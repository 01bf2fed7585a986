"""Rollout engines: one protocol (``base``: generate, update_weights, sleep/wake) and three engines: transformers'
generate (``hf``, with ``hf_compile``: its static-cache, compiled decode step and the watchdog that falls back to
eager), multi-turn episodes with an environment (``agent``) and vLLM (``vllm``, imported only when chosen);
one stop set for all of them (``stop``). Rule (tests/test_layout.py): an engine knows environments, the recipe's
values and the ranks, never the model's training side, the step or the run.
"""
