"""Reward functions: how completions are scored.

A recipe lists weighted reward functions; a sample's reward is the weighted sum of their scores::

    "reward": {"functions": [{"name": "exact_match", "weight": 1.0},
                             {"name": "format", "weight": 0.1},
                             {"name": "my_rewards:length_penalty", "weight": 0.5}],
               "on_error": "zero", "timeout_s": 30}

``name`` is a built-in or your own function as ``package.module:function``, importable from the working
directory or PYTHONPATH. Built-ins (``grpo_ds.rewards.builtin``): ``exact_match``, ``format``,
``math_equivalence`` (final answers compared as exact rationals), ``length_penalty`` (0 up to 512 tokens,
linear to -1 at 1024) and ``code_exec`` (the completion's Python and the row's ``tests`` run in a sandbox,
``grpo_ds.rewards.sandbox``). Built-ins take no options; ``make_length_penalty`` and ``make_code_exec``
build variants with other settings for your own module.

Writing a reward function
-------------------------
Every reward function has this one keyword-only signature::

    def my_reward(*, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  **columns) -> list[float | None]:

It is called once per step on the whole batch. ``completions[i]`` is the generated text of sample
``i``, ``prompts[i]`` the prompt it answers, ``completion_ids[i]`` its generated token ids.
``columns`` holds every dataset column as a list aligned with ``completions`` (a prompt's row is
repeated for each completion of its group), so a column ``answer`` arrives as ``answer=[...]``.
Take the columns you need by name and accept the rest with ``**kwargs``::

    def length_penalty(*, completion_ids, **kwargs):
        return [-len(ids) / 1000 for ids in completion_ids]

Return one value per completion: a float (an int or bool counts as a number), None for
"no score for this sample", which counts as 0.0 in the total and is counted in the metrics as
``none``, or ``RewardError(kind, message)`` for "scoring this sample failed", which is handled like a
failure of the function (below) but for that sample alone.

A function defined with ``async def`` is awaited. All async functions of a step run concurrently in
one event loop (and alongside the sync ones), each with its own ``reward.timeout_s``, after which it is
cancelled. Use it for I/O-bound scoring (a judge model behind an HTTP API, a sandbox); an async function
that blocks without awaiting holds up the others.

When a function fails
---------------------
A function that raises, runs longer than ``reward.timeout_s`` for the batch, returns something
other than a list with one value per completion, or returns items that are not a finite number or
None, does not stop the run by default (``reward.on_error: "zero"``): the affected samples score
0.0 for that function (the whole batch for a raise, timeout or wrong length; just the bad items
otherwise), the count goes into the metrics as ``errors``, and a warning with the cause is logged
once per function and kind of failure. With ``"on_error": "fail"`` the run stops with
``RewardFailure`` instead.

Limitation: Python cannot kill a thread, so a sync call that times out is abandoned, not stopped. It
keeps running in a background (daemon) thread, using CPU and memory, until it returns or the
process exits. A function that can hang should enforce its own limits (e.g. timeouts on network
calls or subprocesses), or be ``async`` so that the timeout cancels it.

Mistakes found when the recipe is loaded (an unknown built-in, a module that does not import or
raises while importing, a missing or non-callable attribute, a signature that cannot take these
keyword arguments) are reported as one-line errors before any model is loaded.
"""

from grpo_ds.rewards.builtin import BUILTIN_REWARDS
from grpo_ds.rewards.item_error import RewardError
from grpo_ds.rewards.loading import RewardFn, RewardFunction, load_reward_functions
from grpo_ds.rewards.scoring import RewardFailure, RewardResult, check_columns, score, unique_names

__all__ = [
    "check_columns",
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFailure",
    "RewardFn",
    "RewardFunction",
    "RewardResult",
    "load_reward_functions",
    "score",
    "unique_names",
]
