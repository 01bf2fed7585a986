"""Run many `python -m MODULE ARGS...` command lines as forks of one process that has already
imported the libraries.

    python tests/scripts/cli_forks.py JOBS_JSON

JOBS_JSON: {"out": folder, "parallel": n, "merged": bool,
            "commands": [{"argv": [module, arg, ...], "cwd": folder}, ...]}.
Every command runs in a child forked from this process after it imported torch, transformers,
DeepSpeed and grpo_ds's libraries (~8-10 s of CPU a fresh `python -m grpo_ds.train` pays each time),
never the command-line module itself: the child runs MODULE as `__main__` (runpy, as `python -m`
does) in its cwd, with its own file descriptors 1 and 2 sent to OUT/<i>.stdout and OUT/<i>.stderr
(merged: both to OUT/<i>.stdout, interleaved as a terminal shows them), and exits with the code the
command line gives (an uncaught
exception: its traceback and 1, as Python does). A child is a process of its own: nothing one
command does is seen by the next. `parallel` children run at a time (1: one after the other, each
seeing what the one before wrote). OUT/<i>.code holds each exit code (negative: killed by that
signal). Used by tests/test_cli_errors.py, tests/test_check.py, tests/test_export.py and
tests/test_docs.py through run_forked().
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PRELOAD = (
    "torch",
    "transformers",
    "deepspeed",
    "grpo_ds.run.preflight",
    "grpo_ds.model.policy",
    "grpo_ds.step.schedule",
    "grpo_ds.step.update",
    "grpo_ds.run.checkpoint",
)


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run_forked(
    commands: list[tuple[list[str], Path]],
    env: dict,
    jobs_dir: Path,
    timeout: int = 600,
    parallel: int = 2,
    merged: bool = False,
) -> list[Finished]:
    """Run each (argv after `python -m`, working directory) as a fork of one preloaded process,
    `parallel` at a time; the results in order (``merged``: each one's stderr is in its stdout, and
    its stderr is empty)."""
    jobs_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs_dir / "jobs.json"
    jobs.write_text(
        json.dumps(
            {
                "out": str(jobs_dir),
                "parallel": parallel,
                "merged": merged,
                "commands": [{"argv": argv, "cwd": str(cwd)} for argv, cwd in commands],
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, __file__, str(jobs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"cli_forks.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    return [
        Finished(
            int((jobs_dir / f"{i}.code").read_text()),
            (jobs_dir / f"{i}.stdout").read_text(),
            "" if merged else (jobs_dir / f"{i}.stderr").read_text(),
        )
        for i in range(len(commands))
    ]


def _child(argv: list[str], cwd: str, stdout: str, stderr: str) -> None:
    """In the forked child: become `python -m argv...` in cwd, then leave with its exit code."""
    code = 70
    try:
        import atexit
        import runpy
        import traceback

        os.chdir(cwd)
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644), fd)
        module = argv[0]
        # runpy puts the module's file in argv[0], as `python -m` does
        sys.argv = [module, *argv[1:]]
        sys.path[0] = os.getcwd()  # `python -m` puts the working directory first on the path
        sys.modules.pop(module, None)
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as leaving:
            if leaving.code is None or isinstance(leaving.code, int):
                code = leaving.code or 0
            else:
                print(leaving.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(jobs_path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    jobs = json.loads(Path(jobs_path).read_text())
    out = Path(jobs["out"])
    running: dict[int, int] = {}  # pid -> command index

    def reap() -> None:
        pid, status = os.wait()
        (out / f"{running.pop(pid)}.code").write_text(str(os.waitstatus_to_exitcode(status)))

    sys.stdout.flush()
    sys.stderr.flush()
    for i, command in enumerate(jobs["commands"]):
        if len(running) == jobs["parallel"]:
            reap()
        pid = os.fork()
        if pid == 0:
            _child(
                command["argv"],
                command["cwd"],
                str(out / f"{i}.stdout"),
                str(out / f"{i}.stdout" if jobs["merged"] else out / f"{i}.stderr"),
            )
        running[pid] = i
    while running:
        reap()


if __name__ == "__main__":
    main(sys.argv[1])
