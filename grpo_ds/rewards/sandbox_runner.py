"""The child side of ``grpo_ds.rewards.sandbox``: confine this process, then run the untrusted code
in it.

Started by ``sandbox.run_python`` as ``python -I -S -B -X utf8 sandbox_runner.py CONFIG.json`` in a
fresh session, with a cleared environment and the throw-away folder as its working directory. It
uses the standard library only (``-S``: no site-packages) and must not import ``grpo_ds``; steps 2
to 5 live in ``sandbox_kernel``, which it loads by its path. In order, before any untrusted byte
runs, it:

1. reads the program and its limits from CONFIG.json (outside the folder, unreadable afterwards);
2. moves into a new, empty network namespace (no interfaces up: nothing is reachable), if the kernel
   lets it; then into a private mount namespace where the folder is a size-limited tmpfs
   (``disk_mb``, ``max_files``): the kernel refuses (ENOSPC) any byte or file beyond the bound,
   however the program writes (many files, deleted-but-open files, mmap, fallocate, threads), and
   nothing it writes reaches the disk;
3. applies a Landlock ruleset (kernel >= 5.13), if available: read-write beneath the folder,
   read-only beneath the Python standard library and the system library folders, nothing elsewhere;
   TCP bind/connect denied (ABI >= 4); no signals to processes outside the sandbox (ABI >= 6);
4. sets resource limits: CPU seconds, address space, file size, open files, no core files, and (for
   a non-root user, where the kernel enforces it) the number of processes;
5. installs a seccomp filter (x86-64), which makes fork/vfork/clone-a-process, socket(), ptrace,
   mount, unshare, setns, raising resource limits and other escape hatches fail with EPERM, even
   from native code;
6. installs an audit hook (which cannot be removed) that refuses process creation, signals, sockets
   other than a local socketpair, ctypes, subinterpreters, raising limits, writing extension modules
   (``.so``), and file access outside the folder (reads are also allowed beneath the standard
   library, except its site-packages);
7. runs the program as ``__main__``.

Steps 2, 3 and 5 are best effort (the kernel may not offer them); steps 4 and 6 always happen (and
the parent watches what the program writes whether or not the folder is a tmpfs). The exit code
tells the parent what happened: 0 the program finished; 1-99 it failed (an exception, or its own
exit code); 101 it ran out of memory; 102 it tried something the sandbox forbids (even if it caught
the error), or filled its size-limited folder; 103 the sandbox could not be set up (not the
program's fault).
"""

import _imp
import importlib.util
import json
import os
import sys
import traceback
import types

EXIT_MEMORY, EXIT_BLOCKED, EXIT_SETUP = 101, 102, 103

# --------------------------------------------------------------------------------------- audit hook

# fmt: off
_ALWAYS_BLOCKED = {
    "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit",
    "resource.prlimit", "os.link", "os.symlink", "cpython.PyInterpreterState_New", "socket.bind",
    "socket.connect", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname",
    "pdb.Pdb", "webbrowser.open",
}
_BLOCKED_MODULES = {"ctypes", "_ctypes", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
# event -> (indices of path arguments, True if the event changes the file system)
_PATH_EVENTS = {
    "os.listdir": ((0,), False), "os.scandir": ((0,), False), "os.getxattr": ((0,), False),
    "os.listxattr": ((0,), False), "os.mkdir": ((0,), True), "os.rmdir": ((0,), True),
    "os.remove": ((0,), True), "os.rename": ((0, 1), True), "os.truncate": ((0,), True),
    "os.chmod": ((0,), True), "os.chown": ((0,), True), "os.utime": ((0,), True),
    "os.setxattr": ((0,), True), "os.removexattr": ((0,), True),
}
# event -> index of its dir_fd argument
_DIR_FD_INDEX = {"os.mkdir": 2, "os.rmdir": 1, "os.remove": 1, "os.rename": 2, "os.chmod": 2,
                 "os.chown": 3, "os.utime": 3}
# fmt: on
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_audit_hook(
    work: str,
    read_dirs: list[str],
    read_files: list[str],
    violations: list[str],
    kernel_stops_forks: bool,
):
    """The hook: raise PermissionError (and record it) for anything outside the policy in the module
    docstring.

    ``_posixsubprocess.fork_exec`` starts processes without an audit event, so that module may only
    be imported (asyncio needs it) when the seccomp filter stops process creation in the kernel.
    The hook reaches its checks through its closure, never through this module's globals.
    """
    blocked_modules = (
        _BLOCKED_MODULES if kernel_stops_forks else _BLOCKED_MODULES | {"_posixsubprocess"}
    )
    realpath, fsdecode = os.path.realpath, os.fsdecode
    refuse = _refuser(violations)
    check_path = _path_checker(work, read_dirs, read_files, refuse)
    check_relative = _relative_name_checker(refuse)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            write = (
                bool(flags & _WRITE_FLAGS)
                if isinstance(flags, int) and flags
                else any(c in (mode or "") for c in "wax+")
            )
            check_path(event, path, write)
        elif event in _PATH_EVENTS:
            indices, write = _PATH_EVENTS[event]
            dir_fd = _DIR_FD_INDEX.get(event)
            # -100: AT_FDCWD
            if dir_fd is not None and len(args) > dir_fd and args[dir_fd] not in (None, -1, -100):
                check_relative(event, [args[i] for i in indices])
                return
            for i in indices:
                check_path(event, args[i], write)
        elif event == "os.chdir":
            if isinstance(args[0], int) or realpath(fsdecode(args[0])) != work:
                # it would shift what relative paths mean
                refuse(event, "changing the working folder")
        elif event == "import":
            if args[0].partition(".")[0] in blocked_modules:
                refuse(event, f"module {args[0]!r}")
        elif event == "socket.__new__":
            # AF_UNIX, i.e. a socketpair (asyncio's self-pipe); socket() itself fails in the kernel
            if args[1] != 1:
                refuse(event, "network sockets")
        elif event in _ALWAYS_BLOCKED or event.startswith(("ctypes.", "syslog.")):
            refuse(event, "not available in the sandbox")

    return hook


def _refuser(violations: list[str]):
    """The hook's refusal: record it in ``violations`` (the runner's exit code reports it even if
    the program catches the error), then raise PermissionError."""

    def refuse(event: str, why: str) -> None:
        violations.append(f"{event}: {why}")
        raise PermissionError(f"sandbox: {event} is not allowed ({why})")

    return refuse


def _path_checker(work: str, read_dirs: list[str], read_files: list[str], refuse):
    """The hook's check of one path: writes beneath ``work`` only, reads also beneath ``read_dirs``
    (not their site-packages) and of ``read_files``; no native extension modules written, and no
    directory outside ``work`` opened."""
    realpath, isdir, fsdecode, sep = os.path.realpath, os.path.isdir, os.fsdecode, os.sep
    # .so files: importing one would run unaudited code
    native_suffixes = tuple(_imp.extension_suffixes())

    def beneath(path: str, base: str) -> bool:
        return path == base or path.startswith(base + sep)

    def readable(path: str) -> bool:
        return (
            beneath(path, work)
            or path in read_files
            or (
                any(beneath(path, d) for d in read_dirs)
                and f"{sep}site-packages" not in path
                and f"{sep}dist-packages" not in path
            )
        )

    def check_path(event: str, path, write: bool) -> None:
        # None = the working folder; an int is an already-open fd
        if path is None or isinstance(path, int):
            return
        resolved = realpath(fsdecode(path))
        if not (beneath(resolved, work) if write else readable(resolved)):
            refuse(
                event,
                f"{'writing' if write else 'reading'} {resolved!r} outside the sandbox folder",
            )
        if write and resolved.endswith(native_suffixes):
            refuse(event, f"writing the native extension module {resolved!r}")
        if event == "open" and not beneath(resolved, work) and isdir(resolved):
            # A directory descriptor outside the folder would let os.open(name, dir_fd=...) escape
            # the path check.
            refuse(event, f"opening the directory {resolved!r}")

    return check_path


def _relative_name_checker(refuse):
    """The hook's check of paths relative to a directory descriptor: such a descriptor exists only
    for folders inside the sandbox (opening any other directory is refused), so a plain name is
    safe (shutil.rmtree works that way)."""
    fsdecode, sep = os.fsdecode, os.sep

    def check_relative(event: str, paths: list) -> None:
        for path in paths:
            name = fsdecode(path) if isinstance(path, (str, bytes)) else "/"
            if sep in name or name in ("", ".", ".."):
                refuse(event, f"the path {name!r} relative to a directory descriptor")

    return check_relative


def _blocked_exit(*args, **kwargs):
    raise PermissionError("sandbox: os._exit is not allowed (return or call sys.exit instead)")


# --------------------------------------------------------------------------------------------- main


def _report(message: str) -> None:
    try:
        sys.__stderr__.write(f"\nsandbox: {message}\n")
        sys.__stderr__.flush()
    except (OSError, ValueError, MemoryError):
        pass


def _exit_code(value) -> int:
    """The program's own exit code (sys.exit semantics), kept clear of the codes the runner
    reserves."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value if 0 <= value < 100 else 1
    print(value, file=sys.stderr)  # sys.exit("message") prints the message and exits with 1
    return 1


def run(compiled, violations: list[str]) -> int:
    """Execute the program as the module __main__ and return the runner's exit code."""
    module = types.ModuleType("__main__")
    # so pickle, dataclasses and typing find the program's own classes
    sys.modules["__main__"] = module
    namespace = module.__dict__
    try:
        exec(compiled, namespace)
        status = 0
    except MemoryError:
        namespace.clear()
        _report("out of memory (the address-space limit was reached)")
        return EXIT_MEMORY
    except SystemExit as stop:
        status = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - every failure of the program is reported the same way
        kind, value, tb = sys.exc_info()
        namespace.clear()
        try:
            # drop run()'s frame
            traceback.print_exception(kind, value, tb.tb_next if tb is not None else None)
        except MemoryError:
            _report("out of memory")
            return EXIT_MEMORY
        status = 1
    if violations:
        _report(
            f"blocked {violations[0]}"
            + (f" (and {len(violations) - 1} more)" if len(violations) > 1 else "")
        )
        return EXIT_BLOCKED
    return status


def main() -> None:
    # The runner ends with os._exit, never with interpreter finalization: finalization clears the
    # audit hooks before it tears modules down, and a program's __del__ would then run unguarded.
    real_exit = os._exit
    try:
        with open(sys.argv[1]) as f:
            cfg = json.load(f)
        with open(cfg["code_path"], encoding="utf-8") as f:
            source = f.read()
        layers = _load_sibling("sandbox_kernel").confine(cfg)
        layers["audit_hook"] = "on" if cfg["audit_hook"] else "off"
    except Exception as err:  # noqa: BLE001 - a setup failure is the parent's problem, reported as such
        print(f"sandbox setup failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        real_exit(EXIT_SETUP)
    if cfg["report_layers"]:
        print(f"sandbox layers: {json.dumps(layers)}", file=sys.stderr, flush=True)
    del sys.argv[1:]
    violations: list[str] = []
    if cfg["audit_hook"]:
        _install_audit_hook(cfg, violations, kernel_stops_forks=layers["seccomp"] == "on")
    try:
        compiled = compile(source, "<solution>", "exec")
        del source
        status = run(compiled, violations)
    except SyntaxError:
        traceback.print_exc()
        status = 1
    except MemoryError:
        _report("out of memory while compiling")
        status = EXIT_MEMORY
    full = layers["disk_limit"].startswith("on") and _folder_full(cfg["work"])
    if full and status != EXIT_BLOCKED:
        _report(
            f"blocked writing: the folder's limit of {cfg['disk_mb']} "
            f"MiB and {cfg['max_files']} files is reached"
        )
        status = EXIT_BLOCKED
    _flush_streams()
    real_exit(status)  # skips atexit handlers, thread joins and teardown: the sandbox ends here


def _load_sibling(name: str) -> types.ModuleType:
    """The module ``name`` beside this file, loaded by its path: the runner starts as a script with
    ``-I`` (its folder is not on sys.path) and must not import ``grpo_ds``."""
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install_audit_hook(cfg: dict, violations: list[str], kernel_stops_forks: bool) -> None:
    """Step 6: the audit hook, and os._exit refused (the runner keeps its own reference)."""
    sys.modules.pop("ctypes", None)  # a later "import ctypes" must go through the hook
    sys.modules.pop("_ctypes", None)
    sys.addaudithook(
        make_audit_hook(
            cfg["work"],
            cfg["read_dirs"],
            [os.path.realpath(__file__)],
            violations,
            kernel_stops_forks=kernel_stops_forks,
        )
    )
    os._exit = sys.modules["posix"]._exit = _blocked_exit


def _folder_full(work: str) -> bool:
    """Whether the size-limited folder is within 1 MiB or 16 files of its bound (counted as
    reached: the program may have caught the ENOSPC)."""
    room = os.statvfs(work)
    return room.f_bavail * room.f_frsize < 2**20 or room.f_favail < 16


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - the program may have closed or replaced its streams
            pass


if __name__ == "__main__":
    main()
