"""run_python: a confined process that contains loops, memory and fork bombs, network and file
access.

Each test runs tiny programs (~0.1 s each); only the timeout tests wait for their limit (1-2 s). The
kernel layers are also tested alone (audit hook off) where this machine has them; elsewhere those
tests skip.
"""

import os
import signal
import sys
import time

import pytest

from grpo_ds.rewards import sandbox
from grpo_ds.rewards.sandbox import (
    DEFAULT_DISK_MB,
    FILES_LIMIT,
    OUTPUT_LIMIT_BYTES,
    run_python,
    sandbox_layers,
)
from tests.launch import stat_fields

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")

LIMITS = {"wall_s": 3.0, "cpu_s": 3, "memory_mb": 256}


def run(code: str, **kwargs):
    return run_python(code, **{**LIMITS, **kwargs})


def layer_on(name: str) -> bool:
    return sandbox_layers()[name].startswith("on")


def process_group_members(pgid: int) -> list[int]:
    # field 5 of the file
    return [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and (fields := stat_fields(pid)) and int(fields[2]) == pgid
    ]


def test_program_runs_with_stdin_and_stdout():
    res = run(
        "import json, math, fractions, collections, re\nprint(input()[::-1], math.isqrt(17))",
        stdin="abc\n",
    )
    assert (res.status, res.returncode, res.stdout) == ("ok", 0, "cba 4\n")


def test_exception_is_an_error_with_a_traceback_of_the_program_only():
    res = run("def f():\n    return 1 / 0\nf()")
    assert (res.status, res.returncode) == ("error", 1)
    assert "ZeroDivisionError" in res.stderr and '"<solution>", line 2' in res.stderr
    assert "sandbox_runner" not in res.stderr


@pytest.mark.parametrize(
    "code, status, returncode",
    [
        ("import sys; sys.exit(0)", "ok", 0),
        ("import sys; sys.exit()", "ok", 0),
        ("raise SystemExit(3)", "error", 3),
        ("import sys; sys.exit(101)", "error", 1),  # the runner's own codes cannot be faked
        ("import sys; sys.exit('bye')", "error", 1),
        ("def f(:\n  pass", "error", 1),  # syntax error
        ("import os; os._exit(0)", "error", 1),  # no exit that skips what follows
    ],
)
def test_exit_codes(code, status, returncode):
    res = run(code)
    assert (res.status, res.returncode) == (status, returncode), res.stderr


def test_infinite_loop_hits_the_wall_time_limit():
    start = time.monotonic()
    res = run("while True:\n    pass", wall_s=1.5, cpu_s=10)
    # the 1.5 s wall limit, not the 10 s CPU one
    assert res.status == "timeout" and time.monotonic() - start < 7.0


def test_sleeping_program_hits_the_wall_time_limit():
    start = time.monotonic()
    res = run("import time\nprint('started', flush=True)\ntime.sleep(60)", wall_s=1.0)
    took = time.monotonic() - start
    # killed at 1 s, not after 60
    assert res.status == "timeout" and res.stdout == "started\n" and took < 10.0


def test_cpu_limit_is_enforced_by_the_kernel():
    res = run("while True:\n    pass", wall_s=10, cpu_s=1)
    assert res.status == "timeout" and res.returncode == -signal.SIGXCPU


@pytest.mark.parametrize(
    "code", ["x = bytearray(2_000_000_000)", "a = []\nwhile True:\n    a.append(' ' * 10**6)"]
)
def test_memory_bomb_is_contained(code):
    res = run(code, memory_mb=256)
    assert res.status == "memory" and "out of memory" in res.stderr


def test_fork_bomb_is_contained_and_leaves_nothing_behind():
    res = run("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()")
    assert res.status == "blocked" and "os.fork" in res.stderr
    assert process_group_members(int(res.stdout)) == []  # the program's process group is gone


def test_process_creation_is_blocked_every_way():
    for code in [
        "import subprocess; subprocess.run(['true'])",
        "import os; os.system('true')",
        "import multiprocessing as mp; mp.Process(target=print).start()",
        "import os; os.execv('/bin/true', ['true'])",
        "import pty; pty.fork()",
    ]:
        assert run(code).status == "blocked", code


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
        "import socket; socket.socket().connect(('8.8.8.8', 53))",
        "import socket; socket.socket(socket.AF_INET, "
        "socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
        "import socket; socket.getaddrinfo('example.com', 80)",
        "import urllib.request; urllib.request.urlopen('http://127.0.0.1:1', timeout=1)",
    ],
)
def test_network_is_blocked(code):
    res = run(code)
    assert res.status == "blocked" and "socket" in res.stderr


def test_reading_outside_the_folder_is_blocked():
    for path in ["/etc/passwd", os.path.abspath(__file__), "/proc/self/environ", "../config.json"]:
        res = run(f"print(open({path!r}).read()[:20])")
        assert res.status == "blocked" and res.stdout == "", path
    assert run("import os; print(os.listdir('/'))").status == "blocked"


def test_writing_outside_the_folder_is_blocked(tmp_path):
    target = tmp_path / "escaped.txt"
    for code in [
        f"open({str(target)!r}, 'w').write('x')",
        "open('../x', 'w').write('x')",
        f"import os; os.mkdir({str(tmp_path / 'd')!r})",
        f"import os; os.remove({str(target)!r})",
        "import os; os.link('/etc/passwd', 'p')",
        "import os; os.symlink('/etc', 'e')",
        "import os; os.chdir('/tmp')",
        "import shutil; shutil.copy('/etc/hostname', 'h')",
    ]:
        assert run(code).status == "blocked", code
    assert list(tmp_path.iterdir()) == []


def test_writing_a_native_extension_is_blocked():
    # an imported .so would run native code that no audit hook sees
    for code in [
        "open('evil.so', 'wb')",
        "import os\nopen('m.txt', 'w').close()\nos.rename('m.txt', 'm.abi3.so')",
    ]:
        res = run(code)
        assert res.status == "blocked" and "native extension" in res.stderr, code


def test_a_caught_violation_still_counts():
    res = run("try:\n    open('/etc/passwd')\nexcept PermissionError:\n    print('caught')")
    assert res.status == "blocked" and res.stdout == "caught\n"


def test_the_folder_is_private_writable_and_removed_afterwards():
    code = (
        "import os, tempfile\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\n"
        "os.rename('a.txt', 'd/b.txt')\n"
        "with tempfile.TemporaryDirectory() as t:\n    open(os.path.join(t, 'x'), 'w').close()\n"
        "print(os.getcwd())\nprint(sorted(os.listdir('.')), open('d/b.txt').read())"
    )
    res = run(code)
    assert res.status == "ok", res.stderr
    folder, listing = res.stdout.splitlines()
    assert listing == "['d'] hi" and not os.path.exists(folder)


def test_environment_is_cleared(monkeypatch):
    monkeypatch.setenv("GRPO_DS_SECRET_TOKEN", "hunter2")
    res = run("import os; print(sorted(os.environ))")
    assert (
        res.status == "ok" and "GRPO_DS_SECRET_TOKEN" not in res.stdout and "PATH" not in res.stdout
    )


def test_output_is_capped():
    res = run(f"print('x' * {4 * OUTPUT_LIMIT_BYTES})")
    assert res.status == "ok" and len(res.stdout) < OUTPUT_LIMIT_BYTES + 100
    assert res.stdout.endswith("[output truncated]")


def test_threads_and_asyncio_work():
    res = run(
        "import threading, asyncio\nout = []\nt = threading.Thread(target=out.append, args=(1,))\n"
        "t.start(); t.join()\nasync def f():\n    await asyncio.sleep(0.01)\n    return 2\n"
        "print(out[0] + asyncio.run(f()))"
    )
    # asyncio imports _posixsubprocess, allowed only when the kernel stops forks
    if not layer_on("seccomp"):
        assert res.status == "blocked"
    else:
        assert (res.status, res.stdout) == ("ok", "3\n"), res.stderr


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="positive"):
        run_python("", wall_s=0)
    with pytest.raises(ValueError, match="disk_mb=0"):
        run_python("", disk_mb=0)


# ---- the disk: what a program writes in total, all files together (RLIMIT_FSIZE bounds one file)

# Ways around a per-file bound, or around a watcher that measures the folder now and then. Each
# would write far more than 8 MiB (1 MiB a step, until its wall-time limit) unless stopped at the
# bound.
DISK_ABUSE = {
    "many files": "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(bytes(2**20))\n    i += 1",
    "delete and rewrite": "import os\nwhile True:\n"
    "    open('f', 'wb').write(bytes(2**20))\n    os.remove('f')",
    "deleted but open": "import os, tempfile\nfiles = []\nwhile True:\n"
    "    f = tempfile.TemporaryFile()\n"
    # no name in the folder
    "    f.write(bytes(2**20)); f.flush(); files.append(f)",
    "threads": "import threading\ndef fill(t):\n    i = 0\n    while True:\n"
    "        open(f'{t}-{i}', 'wb').write(bytes(2**20)); i += 1\n"
    "for t in range(4):\n    threading.Thread(target=fill, args=(t,), daemon=True).start()\n"
    "threading.Event().wait()",
    "caught and kept going": "i = 0\nwhile True:\n    try:\n"
    "        open(f'f{i}', 'wb').write(bytes(2**20))\n"
    "    except OSError:\n        pass\n    i += 1",
    # no write() at all
    "fallocate, deleted": "import os, tempfile, time\nfiles = []\ntry:\n    while True:\n"
    "        f = tempfile.TemporaryFile(); os.posix_fallocate(f.fileno(), 0, 2**20)\n"
    "        files.append(f)\nexcept OSError:\n    time.sleep(60)",
    "empty files": "import os\ni = 0\nwhile True:\n    os.mkdir(f'd{i}'); i += 1",
}
# the parent's watch alone: what a machine without a tmpfs gets
WATCH_ONLY = {"size_limited_folder": False}


@pytest.mark.parametrize("layers", [{}, WATCH_ONLY], ids=["all layers", "watch only"])
@pytest.mark.parametrize("name", list(DISK_ABUSE))
def test_a_program_that_keeps_writing_is_stopped_at_the_total_bound(name, layers):
    # "timeout" would mean it was not stopped
    res = run(DISK_ABUSE[name], disk_mb=8, wall_s=30, **layers)
    assert res.status == "blocked", (res.returncode, res.stderr[-500:])
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("sandbox: blocked") and (
        "MiB" in last or f"{FILES_LIMIT} files" in last
    ), last


@pytest.mark.parametrize("layers", [{}, WATCH_ONLY], ids=["all layers", "watch only"])
def test_writing_within_the_bound_is_fine(layers):
    code = (
        "import os\nfor i in range(5):\n    open(f'f{i}', 'wb').write(bytes(2**20))\n"
        "os.remove('f0')\nprint(sorted(os.listdir('.')), os.path.getsize('f4'))"
    )
    res = run(code, disk_mb=8, **layers)
    assert (res.status, res.stdout) == ("ok", f"{['f1', 'f2', 'f3', 'f4']} {2**20}\n"), res.stderr


def test_the_folder_is_a_size_limited_tmpfs_where_the_kernel_allows_it():
    if not layer_on("disk_limit"):
        pytest.skip(f"no size-limited folder here: {sandbox_layers()['disk_limit']}")
    assert (
        sandbox_layers()["disk_limit"] == f"on (tmpfs, {DEFAULT_DISK_MB} MiB, {FILES_LIMIT} files)"
    )
    res = run(
        "import os\ns = os.statvfs('.')\nprint(s.f_blocks * s.f_frsize >> 20, s.f_files)", disk_mb=8
    )
    assert (res.status, res.stdout) == ("ok", f"8 {FILES_LIMIT}\n"), res.stderr
    # what a write past the bound meets: ENOSPC from the kernel, before a byte more is stored
    # (unless the parent, which sees the full folder, kills the program first)
    res = run(
        "try:\n    open('big', 'wb').write(bytes(12 * 2**20))\n"
        "except OSError as e:\n    print(e.errno)",
        disk_mb=8,
        memory_mb=512,
    )
    assert res.status == "blocked" and res.stdout in ("28\n", ""), res.stderr  # errno 28: ENOSPC


def test_a_program_that_fills_its_tmpfs_and_catches_enospc_is_blocked_by_the_runner_alone(
    monkeypatch,
):
    """Where the parent cannot look into the program's mount namespace, the runner itself reports
    the full folder as the program ends (here: the file limit, reached with empty files, so no byte
    is written)."""
    if not layer_on("disk_limit"):
        pytest.skip(f"no size-limited folder here: {sandbox_layers()['disk_limit']}")
    monkeypatch.setattr(sandbox, "_tmpfs_full", lambda *args: False)
    code = (
        "i = 0\ntry:\n    while True:\n        open(f'f{i}', 'w').close(); i += 1\n"
        "except OSError as e:\n"
        "    print(e.errno, i >= 4000)"
    )
    res = run(code, disk_mb=8)
    assert (res.status, res.stdout) == ("blocked", "28 True\n"), res.stderr
    assert res.stderr.strip().endswith(
        f"the folder's limit of 8 MiB and {FILES_LIMIT} files is reached"
    )


# ---- the kernel layers alone (audit hook off): what native code would meet


def test_kernel_stops_forks_without_the_audit_hook():
    if not layer_on("seccomp"):
        pytest.skip(f"no seccomp filter here: {sandbox_layers()['seccomp']}")
    code = (
        "import os, ctypes\ntry:\n    os.fork()\nexcept OSError as e:\n    print(e.errno)\n"
        "print(ctypes.CDLL(None, use_errno=True).fork() == -1)"
    )
    res = run(code, audit_hook=False)
    # EPERM, from Python and from C
    assert (res.status, res.stdout) == ("ok", "1\nTrue\n"), res.stderr


def test_kernel_stops_network_without_the_audit_hook():
    if not (
        layer_on("seccomp")
        or layer_on("network_namespace")
        or "tcp" in sandbox_layers()["landlock"]
    ):
        pytest.skip("no kernel network layer here")
    code = (
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        "except OSError:\n    print('no')"
    )
    res = run(code, audit_hook=False)
    assert (res.status, res.stdout) == ("ok", "no\n"), res.stderr


def test_kernel_stops_file_access_without_the_audit_hook(tmp_path):
    if not layer_on("landlock"):
        pytest.skip(f"no Landlock here: {sandbox_layers()['landlock']}")
    code = (
        f"for path, mode in [('/etc/passwd', 'r'), ({os.path.abspath(__file__)!r}, 'r'), "
        f"({str(tmp_path / 'x')!r}, 'w'), ('../x', 'w')]:\n"
        "    try:\n        open(path, mode)\n        print('opened', path)\n"
        "    except PermissionError:\n        pass\nprint('done')"
    )
    res = run(code, audit_hook=False)
    assert (res.status, res.stdout) == ("ok", "done\n"), res.stdout + res.stderr
