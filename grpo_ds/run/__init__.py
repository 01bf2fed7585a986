"""The run outside the step: its inputs checked before any model loads (``preflight``, with the prompt data in
``prompts``), its folder on disk (``folder``: fresh, resume or refuse, and the output-path checks), atomic checkpoints
(``checkpoint``), writes that fail as one line (``writes``), stop signals honoured at a step boundary
(``preemption``) and the metrics it logs and reads back (``metrics``).
Rule (tests/test_layout.py): nothing here imports the step or the CLIs.
"""
