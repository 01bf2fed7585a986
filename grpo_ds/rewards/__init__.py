"""Reward functions: how completions are scored.

A recipe lists weighted reward functions; a sample's reward is the weighted sum of their scores::

    "reward": {"functions": [{"name": "exact_match", "weight": 1.0},
                             {"name": "format", "weight": 0.1},
                             {"name": "my_rewards:length_penalty", "weight": 0.5}],
               "on_error": "zero", "timeout_s": 30}

``name`` is a built-in (``exact_match``, ``format``; see ``grpo_ds.rewards.builtin``) or your own
function as ``package.module:function``, importable from the working directory or PYTHONPATH.

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

Return one value per completion: a float (an int or bool counts as a number), or None for
"no score for this sample", which counts as 0.0 in the total and is counted in the metrics as
``none``.

When a function fails
---------------------
A function that raises, runs longer than ``reward.timeout_s`` for the batch, returns something
other than a list with one value per completion, or returns items that are not a finite number or
None, does not stop the run by default (``reward.on_error: "zero"``): the affected samples score
0.0 for that function (the whole batch for a raise, timeout or wrong length; just the bad items
otherwise), the count goes into the metrics as ``errors``, and a warning with the cause is logged
once per function and kind of failure. With ``"on_error": "fail"`` the run stops with
``RewardFailure`` instead.

Limitation: Python cannot kill a thread, so a call that times out is abandoned, not stopped. It
keeps running in a background (daemon) thread, using CPU and memory, until it returns or the
process exits. A function that can hang should enforce its own limits (e.g. timeouts on network
calls or subprocesses).

Mistakes found when the recipe is loaded (an unknown built-in, a module that does not import or
raises while importing, a missing or non-callable attribute, a signature that cannot take these
keyword arguments) are reported as one-line errors before any model is loaded.
"""

from grpo_ds.rewards.builtin import BUILTIN_REWARDS
from grpo_ds.rewards.loading import RewardFunction, load_reward_functions
from grpo_ds.rewards.scoring import RewardFailure, RewardResult, check_columns, score, unique_names

__all__ = [
    "check_columns",
    "BUILTIN_REWARDS",
    "RewardFailure",
    "RewardFunction",
    "RewardResult",
    "load_reward_functions",
    "score",
    "unique_names",
]
