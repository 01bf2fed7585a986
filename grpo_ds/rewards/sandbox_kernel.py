"""The kernel layers of the sandbox's child (``sandbox_runner``), steps 2 to 5 of its list: a new
network namespace, a size-limited folder, Landlock, resource limits and a seccomp filter.

Like the runner, it uses the standard library only and must not import ``grpo_ds``: the runner,
started as a script with ``python -I -S``, loads this file by its path (``confine`` is the entry).
Each layer but the resource limits is best effort and says how it went, or why not.
"""

import ctypes
import os
import platform
import resource
import struct
import sys


def confine(cfg: dict) -> dict[str, str]:
    """Apply the layers in order (CFG is the runner's CONFIG.json); return how each went."""
    global _LIBC
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.syscall.restype = ctypes.c_long
    uid = os.getuid()
    # before Landlock hides /proc
    nproc = None if uid == 0 else tasks_of_user(uid) + cfg["nproc_margin"]
    layers = {"network_namespace": unshare_network()}
    layers["disk_limit"] = size_limited_folder(cfg["work"], cfg["disk_mb"], cfg["max_files"])
    layers["landlock"] = landlock(cfg["work"], cfg["read_dirs"] + cfg["lib_paths"])
    set_limits(cfg["cpu_s"], cfg["memory_mb"], cfg["file_mb"], cfg["nofile"], nproc)
    layers["seccomp"] = seccomp()
    return layers


# the C library, loaded by confine(): importing this module has no side effects
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


def tasks_of_user(uid: int) -> int:
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
