"""The child side of ``grpo_ds.rewards.sandbox``: confine this process, then run the untrusted code
in it.

Started by ``sandbox.run_python`` as ``python -I -S -B -X utf8 sandbox_runner.py CONFIG.json`` in a
fresh session, with a cleared environment and the throw-away folder as its working directory. It
uses the standard library only (``-S``: no site-packages) and must not import ``grpo_ds``. In order,
before any untrusted byte runs, it:

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
import ctypes
import json
import os
import platform
import resource
import struct
import sys
import traceback
import types

EXIT_MEMORY, EXIT_BLOCKED, EXIT_SETUP = 101, 102, 103

# ------------------------------------------------------------------------------------ kernel layers

# the C library, loaded by main(): importing this module (the parent does) has no side effects
_LIBC = None
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


def unshare_network() -> str:
    """Enter a new network namespace (only a loopback device, down). Returns how, or why not."""
    if _LIBC.unshare(_CLONE_NEWNET) == 0:
        return "on"
    reason = _errno_text()
    uid, gid = os.getuid(), os.getgid()
    # unprivileged user namespace
    if uid != 0 and _LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        _map_own_ids(uid, gid)
        return "on (user namespace)"
    return f"off ({reason})"


def _map_own_ids(uid: int, gid: int) -> None:
    """Map our uid and gid into the new user namespace as themselves (a tmpfs mounted there needs
    them to own files)."""
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            return


_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE, _MNT_DETACH = 2, 4, 8, 1 << 14, 1 << 18, 2


def size_limited_folder(work: str, disk_mb: int, max_files: int) -> str:
    """Mount a tmpfs of ``disk_mb`` MiB and ``max_files`` inodes on ``work`` in a private mount
    namespace and move into it (before Landlock, whose rules name the folder's inode). Returns how,
    or why not."""
    if disk_mb <= 0 or _LIBC.unshare(_CLONE_NEWNS) != 0:
        return f"off ({_errno_text() if disk_mb > 0 else 'not asked for'})"
    # private first: a mount in a namespace copied from a shared "/" would propagate back to the
    # host's
    if _LIBC.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return f"off (making / private: {_errno_text()})"
    options = f"size={disk_mb}m,nr_inodes={max_files},mode=0700".encode()
    if (
        _LIBC.mount(
            b"grpo_ds_sandbox",
            os.fsencode(work),
            b"tmpfs",
            _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
            options,
        )
        != 0
    ):
        return f"off ({_errno_text()})"
    # the process's folder was the directory now covered; the tmpfs is the folder from here on
    os.chdir(work)
    try:  # our uid must be able to create files there (an unmapped user namespace would refuse it)
        open(os.path.join(work, ".probe"), "w").close()
        os.remove(os.path.join(work, ".probe"))
    except OSError as err:
        os.chdir("/")
        _LIBC.umount2(os.fsencode(work), _MNT_DETACH)
        os.chdir(work)
        return f"off (files cannot be created in it: {err.strerror})"
    return f"on (tmpfs, {disk_mb} MiB, {max_files} files)"


# Landlock (Documentation/userspace-api/landlock.rst). Syscall numbers are the same on every
# architecture.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
_LL_FILE_READ = (1 << 0) | (1 << 2)  # the subset that applies to a regular file


def _ll_fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= 1 << 13  # REFER
    if abi >= 3:
        rights |= 1 << 14  # TRUNCATE
    if abi >= 5:
        rights |= 1 << 15  # IOCTL_DEV
    return rights


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(work: str, read_only: list[str]) -> str:
    """Confine file access to ``work`` (all rights) and ``read_only`` (read, execute); deny TCP.
    Returns a summary."""
    abi = _LIBC.syscall(_LL_CREATE, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return f"off ({_errno_text()})"
    fs = _ll_fs_rights(abi)
    net = 0b11 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, with no rule allowing any port
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets and signals stay inside the sandbox
    attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _LIBC.syscall(_LL_CREATE, attr, len(attr), 0)
    if ruleset < 0:
        return f"off ({_errno_text()})"
    try:
        _landlock_restrict(ruleset, work, fs, read_only)
    # best effort, like the other kernel layers; the audit hook still guards files
    except OSError as err:
        return f"off ({err})"
    finally:
        os.close(ruleset)
    return f"on (ABI {abi}{', tcp' if net else ''}{', signals' if scoped else ''})"


def _landlock_restrict(ruleset: int, work: str, fs: int, read_only: list[str]) -> None:
    """Add the rules (all rights beneath ``work``, read and execute beneath ``read_only``), then
    enforce them."""
    for path, rights in [(work, fs)] + [(p, _LL_READ) for p in read_only]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a library folder this system does not have
        try:
            if not os.path.isdir(path):
                rights &= _LL_FILE_READ  # a file (e.g. /etc/ld.so.cache) takes file rights only
            rule = _PathBeneath(rights, fd)
            if _LIBC.syscall(_LL_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                raise OSError(f"landlock_add_rule({path}): {_errno_text()}")
        finally:
            os.close(fd)
    if _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(f"prctl(NO_NEW_PRIVS): {_errno_text()}")
    if _LIBC.syscall(_LL_RESTRICT, ruleset, 0) != 0:
        raise OSError(f"landlock_restrict_self: {_errno_text()}")


def set_limits(cpu_s: int, memory_mb: int, file_mb: int, nofile: int, nproc: int | None) -> None:
    """Kernel-enforced limits on this process and everything it could start. Soft and hard limits
    are equal."""
    # SIGXCPU at cpu_s, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20,) * 2)
    # also caps the captured stdout/stderr
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc,) * 2)


def _tasks_of_user(uid: int) -> int:
    """Threads owned by ``uid`` on the machine: RLIMIT_NPROC counts them all, so the limit is
    relative to it."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, ValueError, KeyError):
            continue  # not a process, or it exited meanwhile
    return count


# seccomp BPF (x86-64 only: the syscall numbers are architecture-specific and only these are
# tested).
_AUDIT_ARCH_X86_64 = 0xC000003E
# fmt: off
_SYS = {
    "clone": 56, "fork": 57, "vfork": 58, "clone3": 435, "socket": 41, "ptrace": 101,
    "setrlimit": 160, "prlimit64": 302, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "unshare": 272, "setns": 308, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "bpf": 321,
    "perf_event_open": 298, "io_uring_setup": 425, "process_vm_readv": 310,
    "process_vm_writev": 311, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
}
# fmt: on
_DENY = [n for k, n in _SYS.items() if k not in ("clone", "clone3", "prlimit64")]
_CLONE_THREAD = 0x00010000
_EPERM, _ENOSYS = 1, 38


def _bpf_program() -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) instructions: deny the escape syscalls with EPERM, allow everything
    else."""
    # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JSET|K, JMP|JGE|K, RET|K
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, deny, enosys = 0x7FFF0000, 0x00050000 | _EPERM, 0x00050000 | _ENOSYS
    # SECCOMP_RET_KILL_PROCESS: a foreign ABI (32-bit int 0x80 calls) is never legitimate
    kill = 0x80000000
    prog: list[tuple] = [
        (ld, 0, 0, 4),
        (jeq, 1, 0, _AUDIT_ARCH_X86_64),
        (ret, 0, 0, kill),
        (ld, 0, 0, 0),
    ]
    labels: dict[str, int] = {}
    # (index, label if true, label if false); "" = fall through
    jumps: list[tuple[int, str, str]] = []

    def emit(code, k, if_true="", if_false=""):
        if if_true or if_false:
            jumps.append((len(prog), if_true, if_false))
        prog.append((code, 0, 0, k))

    emit(jge, 0x40000000, "deny")  # the x32 ABI: syscall numbers with bit 30 set
    for nr in _DENY:
        emit(jeq, nr, "deny")
    emit(jeq, _SYS["clone"], "clone")
    # glibc then falls back to clone(), whose flags we can inspect
    emit(jeq, _SYS["clone3"], "enosys")
    emit(jeq, _SYS["prlimit64"], "prlimit")
    emit(ret, allow)
    # classic BPF jumps only forward: the checks come before the shared returns
    labels["clone"] = len(prog)
    emit(ld, 16)  # args[0] (flags), low 32 bits: a thread shares the process and is allowed
    emit(jset, _CLONE_THREAD, "allow", "deny")
    labels["prlimit"] = len(prog)
    emit(ld, 32)  # args[2] (new limit pointer): reading limits is fine, setting them is not
    emit(jeq, 0, "", "deny")
    emit(ld, 36)
    emit(jeq, 0, "allow", "deny")
    labels["allow"] = len(prog)
    emit(ret, allow)
    labels["deny"] = len(prog)
    emit(ret, deny)
    labels["enosys"] = len(prog)
    emit(ret, enosys)
    for index, if_true, if_false in jumps:
        code, _, _, k = prog[index]
        jt = labels[if_true] - index - 1 if if_true else 0
        jf = labels[if_false] - index - 1 if if_false else 0
        prog[index] = (code, jt, jf, k)
    return prog


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp() -> str:
    """Install the syscall filter for the rest of this process's life (inherited by anything it
    starts)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"off (no filter for {platform.machine()})"
    prog = _bpf_program()
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    if _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"off ({_errno_text()})"
    if _LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return f"off ({_errno_text()})"
    return "on"


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
    """
    blocked_modules = (
        _BLOCKED_MODULES if kernel_stops_forks else _BLOCKED_MODULES | {"_posixsubprocess"}
    )
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

    def refuse(event: str, why: str) -> None:
        violations.append(f"{event}: {why}")
        raise PermissionError(f"sandbox: {event} is not allowed ({why})")

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
                # Relative to a directory descriptor, which exists only for folders inside the
                # sandbox (opening any other directory is refused), so a plain name is safe
                # (shutil.rmtree works that way).
                for i in indices:
                    name = fsdecode(args[i]) if isinstance(args[i], (str, bytes)) else "/"
                    if sep in name or name in ("", ".", ".."):
                        refuse(event, f"the path {name!r} relative to a directory descriptor")
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
    global _LIBC
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.syscall.restype = ctypes.c_long
    # The runner ends with os._exit, never with interpreter finalization: finalization clears the
    # audit hooks before it tears modules down, and a program's __del__ would then run unguarded.
    real_exit = os._exit
    try:
        with open(sys.argv[1]) as f:
            cfg = json.load(f)
        with open(cfg["code_path"], encoding="utf-8") as f:
            source = f.read()
        uid = os.getuid()
        # before Landlock hides /proc
        nproc = None if uid == 0 else _tasks_of_user(uid) + cfg["nproc_margin"]
        layers = {"network_namespace": unshare_network()}
        layers["disk_limit"] = size_limited_folder(cfg["work"], cfg["disk_mb"], cfg["max_files"])
        layers["landlock"] = landlock(cfg["work"], cfg["read_dirs"] + cfg["lib_paths"])
        set_limits(cfg["cpu_s"], cfg["memory_mb"], cfg["file_mb"], cfg["nofile"], nproc)
        layers["seccomp"] = seccomp()
        layers["audit_hook"] = "on" if cfg["audit_hook"] else "off"
    except Exception as err:  # noqa: BLE001 - a setup failure is the parent's problem, reported as such
        print(f"sandbox setup failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        real_exit(EXIT_SETUP)
    if cfg["report_layers"]:
        print(f"sandbox layers: {json.dumps(layers)}", file=sys.stderr, flush=True)
    del sys.argv[1:]
    violations: list[str] = []
    if cfg["audit_hook"]:
        sys.modules.pop("ctypes", None)  # a later "import ctypes" must go through the hook
        sys.modules.pop("_ctypes", None)
        sys.addaudithook(
            make_audit_hook(
                cfg["work"],
                cfg["read_dirs"],
                [os.path.realpath(__file__)],
                violations,
                kernel_stops_forks=layers["seccomp"] == "on",
            )
        )
        os._exit = sys.modules["posix"]._exit = _blocked_exit
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
    # within 1 MiB: reached
    room = os.statvfs(cfg["work"]) if layers["disk_limit"].startswith("on") else None
    full = room is not None and (room.f_bavail * room.f_frsize < 2**20 or room.f_favail < 16)
    if full and status != EXIT_BLOCKED:
        _report(
            f"blocked writing: the folder's limit of {cfg['disk_mb']} "
            f"MiB and {cfg['max_files']} files is reached"
        )
        status = EXIT_BLOCKED
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - the program may have closed or replaced its streams
            pass
    real_exit(status)  # skips atexit handlers, thread joins and teardown: the sandbox ends here


if __name__ == "__main__":
    main()
