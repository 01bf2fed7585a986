"""The run outside the step: its inputs checked before any model loads (``preflight``, with the
prompt data in ``prompts``), its folder on disk (``folder``: fresh, resume or refuse, and the
output-path checks) and one owner for it (``lock``), every folder a run writes in, made and probed
with a write before anything loads (``output_paths``), atomic checkpoints (``checkpoint``) and
resuming one on another world size (``universal``: DeepSpeed's universal checkpoint), a
checkpoint's ZeRO shards joined into one state dict for the export (``consolidate``), writes that
fail as one line (``writes``), stop signals honoured at a step boundary (``preemption``), the
metrics it logs and reads back (``metrics``) and the curves drawn from them (``curves``), each
rank's phases over wall time read back from its log (``timeline``), host memory that large
frees hand back to the system between the training passes (``host_allocator``), the builtin
reward models written into grpo_ds's cache on first use (``builtin_models``), and models and
datasets named by a Hugging Face Hub id, fetched into the Hugging Face cache once per node
(``hub``; a dataset's files and rows: ``hub_data``). Rule
(tests/test_layout.py): nothing here imports the step or the CLIs.
"""
