"""Reward functions: how completions are scored.

Modules: the recipe's specs turned into callables (``loading``), a batch scored with them and the
reward models' scores added (``scoring``: ``score_functions``, ``add_model_scores``), in worker
processes (``pool``, each one ``worker``), a per-sample failure (``item_error``); the built-ins
(``builtin``), with the final-answer extraction they share (``final_answer``), ``math_equivalence``
(``math_answer``) and ``code_exec`` (``code_exec``), which runs untrusted code in a confined process
(``sandbox``, whose child side is ``sandbox_runner``, with its kernel layers in
``sandbox_kernel``).

A recipe lists weighted reward functions; a sample's reward is the weighted sum of their scores::

    "reward": {"functions": [{"name": "exact_match", "weight": 1.0},
                             {"name": "format", "weight": 0.1},
                             {"name": "my_rewards:length_penalty", "weight": 0.5}],
               "on_error": "zero", "timeout_s": 30}

``name`` is a built-in or your own function as ``package.module:function``, importable from the
working directory or PYTHONPATH. Built-ins (``grpo_ds.rewards.builtin``): ``exact_match``,
``format``, ``math_equivalence`` (final answers compared as exact rationals), ``length_penalty`` (0
up to 512 tokens, linear to -1 at 1024) and ``code_exec`` (the completion's Python and the row's
``tests`` run in a sandbox, ``grpo_ds.rewards.sandbox``). Built-ins take no options;
``make_length_penalty`` and ``make_code_exec`` build variants with other settings for your own
module.

Writing a reward function
-------------------------
Every reward function has this one keyword-only signature::

    def my_reward(*, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  **columns) -> list[float | None]:

It is called on a chunk of the step's batch (below). ``completions[i]`` is the generated text of
sample ``i``, ``prompts[i]`` the prompt it answers, ``completion_ids[i]`` its generated token ids.
``columns`` holds every dataset column as a list aligned with ``completions`` (a prompt's row is
repeated for each completion of its group), so a column ``answer`` arrives as ``answer=[...]``.
Take the columns you need by name and accept the rest with ``**kwargs``::

    def length_penalty(*, completion_ids, **kwargs):
        return [-len(ids) / 1000 for ids in completion_ids]

Return one value per completion: a float (an int or bool counts as a number), None for
"no score for this sample", which counts as 0.0 in the total and is counted in the metrics as
``none``, or ``RewardError(kind, message)`` for "scoring this sample failed", which is handled like
a failure of the function (below) but for that sample alone.

The step's completions are cut into chunks of ``reward.chunk_samples`` (whole groups), and each
function is called once per chunk, in rank 0's reward worker processes (``rewards.pool``,
``reward.processes``), so scores do not depend on the number of workers. A function defined with
``async def`` is awaited.

When a function fails
---------------------
A call that raises, runs longer than ``reward.timeout_s``, ends its worker process (a segfault,
``os._exit``), returns something other than a list with one value per completion, or returns items
that are not a finite number or None, does not stop the run by default
(``reward.on_error: "zero"``): the affected samples score 0.0 for that function (the chunk for a
raise, timeout, crash or wrong length; just the bad items otherwise), the count goes into the
metrics as ``errors``, and a warning with the cause is logged once per function and kind of failure.
A worker that timed out is killed and, like one that died, replaced. With ``"on_error": "fail"`` the
run stops with ``RewardFailure``: one line naming the function, exit code 2.

With ``reward.processes: 0`` the calls run in the trainer's process instead, without that
containment: a sync call that times out is abandoned (Python cannot kill a thread) and one that ends
its process ends the run.

Mistakes found when the recipe is loaded (an unknown built-in, a module that does not import or
raises while importing, a missing or non-callable attribute, a signature that cannot take these
keyword arguments) are reported as one-line errors before any model is loaded.
"""

from grpo_ds.rewards.builtin import BUILTIN_REWARDS
from grpo_ds.rewards.item_error import RewardError
from grpo_ds.rewards.loading import RewardFn, RewardFunction, load_reward_functions
from grpo_ds.rewards.scoring import (
    RewardFailure,
    RewardResult,
    add_model_scores,
    check_columns,
    score_functions,
    unique_names,
)

__all__ = [
    "add_model_scores",
    "check_columns",
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFailure",
    "RewardFn",
    "RewardFunction",
    "RewardResult",
    "load_reward_functions",
    "score_functions",
    "unique_names",
]
