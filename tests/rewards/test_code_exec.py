"""code_exec: the completion's code plus the row's tests, in the sandbox; abuse is scored per
reward.on_error."""

import asyncio
import sys
import time

import pytest

from grpo_ds.config.reward_specs import RewardFunctionSpec
from grpo_ds.rewards import (
    RewardError,
    RewardFailure,
    RewardFunction,
    load_reward_functions,
    score_functions,
    scoring,
)
from grpo_ds.rewards.builtin import format_reward
from grpo_ds.rewards.code_exec import build_program, extract_code, make_code_exec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
fast = make_code_exec(wall_s=1.5, cpu_s=2, memory_mb=256, disk_mb=8, max_parallel=2)

# Each is contained by the sandbox; code_exec reports it as a RewardError of this kind.
ABUSE = {
    "infinite loop": ("```python\nwhile True:\n    pass\n```", "timeout"),
    "memory bomb": ("```python\nx = bytearray(4_000_000_000)\n```", "memory"),
    "fork bomb": ("```python\nimport os\nwhile True:\n    os.fork()\n```", "blocked"),
    "network": (
        "```python\nimport socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)\n```",
        "blocked",
    ),
    "read outside": ("```python\nprint(open('/etc/passwd').read())\n```", "blocked"),
    "write outside": ("```python\nopen('../escaped', 'w').write('x')\n```", "blocked"),
    "disk filler": (
        "```python\ni = 0\nwhile True:\n"
        "    open(f'f{i}', 'wb').write(bytes(2**20))\n    i += 1\n```",
        "blocked",
    ),
}


@pytest.fixture(autouse=True)
def fresh_warnings():
    scoring._WARNED.clear()
    yield
    scoring._WARNED.clear()


def call(fn, completions, tests):
    return asyncio.run(
        fn(
            prompts=["p"] * len(completions),
            completions=completions,
            completion_ids=[[1]] * len(completions),
            tests=tests,
        )
    )


@pytest.mark.parametrize(
    "completion, code",
    [
        # the last python block
        ("text\n```python\nx = 1\n```\nmore\n```python\nx = 2\n```\nend", "x = 2\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```Python3\nx = 1\n```", "x = 1\n"),
        ("```\nx = 1\n```", "x = 1\n"),  # untagged
        # a python block beats other languages
        ("```python\nx = 1\n```\n```bash\nls\n```", "x = 1\n"),
        ("x = 1\nprint(x)", "x = 1\nprint(x)"),  # no fence: all of it
    ],
)
def test_extract_code(completion, code):
    assert extract_code(completion) == code


def test_scores_correct_wrong_broken_and_untested_samples():
    completions = [
        GOOD,
        WRONG,
        "```python\ndef add(a, b:\n```",
        GOOD,
        "def add(a, b): return a + b",
    ]
    tests = [TESTS, TESTS, TESTS, None, [TESTS, "assert add(0, 0) == 0"]]
    assert call(fast, completions, tests) == [1.0, 0.0, 0.0, None, 1.0]


def test_exiting_early_does_not_skip_the_tests():
    exits = "```python\nimport sys\ndef add(a, b):\n    return a - b\nsys.exit(0)\n```"
    main = (
        "```python\nimport sys\ndef add(a, b):\n    return a + b\n"
        "def main():\n    pass\nsys.exit(main())\n```"
    )
    assert call(fast, [exits, main], [TESTS, TESTS]) == [0.0, 1.0]


def test_program_layout():
    program = build_program("print('''x''')", "assert True")
    assert program.endswith("assert True\n") and "'<solution>'" in program


def test_missing_tests_column_says_which_column():
    with pytest.raises(ValueError, match="'tests'"):
        asyncio.run(fast(prompts=["p"], completions=[GOOD], completion_ids=[[1]], answer=["5"]))


@pytest.mark.parametrize("name", list(ABUSE))
def test_each_abuse_is_a_per_sample_reward_error(name):
    completion, kind = ABUSE[name]
    (result,) = call(fast, [completion], [TESTS])
    assert isinstance(result, RewardError) and result.kind == kind


def run_score(completions, on_error, fn=fast):
    n = len(completions)
    return score_functions(
        [RewardFunction("code_exec", 1.0, fn), RewardFunction("format", 0.5, format_reward)],
        prompts=["p"] * n,
        completions=completions,
        completion_ids=[[1]] * n,
        columns={"tests": [TESTS] * n},
        on_error=on_error,
        timeout_s=60,
    )


def test_abuse_scores_zero_is_counted_and_the_batch_goes_on(caplog):
    completions = [GOOD, *(completion for completion, _ in ABUSE.values()), WRONG, GOOD]
    start = time.monotonic()
    res = run_score(completions, "zero")
    elapsed = time.monotonic() - start
    assert res.per_function["code_exec"] == [1.0] + [0.0] * len(ABUSE) + [0.0, 1.0]
    assert res.errors["code_exec"] == len(ABUSE)  # the wrong answer is a 0.0, not an error
    assert res.per_function["format"] == [0.0] * len(completions) and res.errors["format"] == 0
    assert res.total == res.per_function["code_exec"]
    assert elapsed < 10  # the one timeout (1.5 s) overlaps the other programs
    # one warning per kind, naming the function and a sample
    for kind in ("timeout", "memory", "blocked"):
        assert "'code_exec' failed on" in caplog.text and f"({kind}; sample" in caplog.text


@pytest.mark.parametrize("name", list(ABUSE))
def test_abuse_with_on_error_fail_stops_the_run(name):
    completion, kind = ABUSE[name]
    with pytest.raises(
        RewardFailure, match=rf"'code_exec': failed on 1 of 2 samples \({kind}; sample 1"
    ):
        run_score([GOOD, completion], "fail")


def test_loads_by_name_and_runs_concurrently_with_the_batch_timeout():
    (func,) = load_reward_functions([RewardFunctionSpec("code_exec", 1.0)])
    slow = make_code_exec(wall_s=30, max_parallel=4)
    sleeper = "```python\nimport time\ntime.sleep(8)\n```"
    start = time.monotonic()
    res = score_functions(
        [RewardFunction("code_exec", 1.0, slow)],
        prompts=["p"] * 4,
        completions=[sleeper] * 4,
        completion_ids=[[1]] * 4,
        columns={"tests": [TESTS] * 4},
        on_error="zero",
        timeout_s=0.5,
    )
    # cancelled at timeout_s (0.5 s), not after the sleeps (8 s)
    assert time.monotonic() - start < 5.0
    assert res.errors["code_exec"] == 4 and func.name == "code_exec"


def test_max_parallel_must_be_positive():
    with pytest.raises(ValueError, match="max_parallel"):
        make_code_exec(max_parallel=0)
