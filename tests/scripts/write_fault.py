"""Fault injection for the write-failure tests: one write of the run fails as a full disk, a
read-only file system or an exceeded quota would make it fail.

``install(Fault(...))`` patches the writers a run uses (torch.save, Path.write_text, Path.open for
appends, Path.mkdir, os.rename, os.replace, and DeepSpeed's own copyfile and open) so that the
``nth`` call whose path ends with ``suffix`` raises ``OSError(code)`` (a write that fails mid-file
first leaves a partial file, as a full disk does). With ``hidden``, torch.save raises what torch's
zip writer raises on a full disk (a RuntimeError that names no cause), and from then on the disk is
full: the probe write grpo_ds.run.writes makes to find the cause fails too.

Run as a module, this is ``python -m grpo_ds.train`` with the fault of ``$GRPO_DS_WRITE_FAULT``
(``function:suffix:ERRNO_NAME[:nth]``, e.g.
``torch.save:.tmp-step_00000004/rng/rank0.pt:ENOSPC``)."""

from __future__ import annotations

import errno
import os
import pathlib
from dataclasses import dataclass

import torch

# torch 2.x, ENOSPC
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
WRITERS = (
    "torch.save",
    "write_text",
    "append",
    "mkdir",
    "os.rename",
    "os.replace",
    "deepspeed.copyfile",
    "deepspeed.open",
)


@dataclass
class Fault:
    writer: str  # one of WRITERS
    suffix: str  # the path (the source of a rename) ends with this
    code: int = errno.ENOSPC
    nth: int = 1  # the nth matching call fails (earlier ones succeed)
    hidden: bool = False  # torch.save only: raise torch's RuntimeError, and the disk stays full
    calls: int = 0
    fired: bool = False

    def hits(self, writer: str, path) -> bool:
        if self.fired or writer != self.writer or not str(path).endswith(self.suffix):
            return False
        self.calls += 1
        self.fired = self.calls == self.nth
        return self.fired

    def error(self, path=None, named: bool = True) -> OSError:
        return OSError(
            self.code, os.strerror(self.code), *([str(path)] if named and path is not None else [])
        )


def install(fault: Fault, patch=None) -> Fault:
    """Patch the writers with ``patch(obj, name, value, raising=...)`` (pytest's
    monkeypatch.setattr, undone after the test; by default ``setattr``, for good)."""
    import deepspeed.runtime.engine as ds_engine

    patch = patch or (lambda obj, name, value, raising=True: setattr(obj, name, value))
    real = {
        "torch.save": torch.save,
        "write_text": pathlib.Path.write_text,
        "open": pathlib.Path.open,
        "mkdir": pathlib.Path.mkdir,
        "os.rename": os.rename,
        "os.replace": os.replace,
        "copyfile": ds_engine.copyfile,
    }

    def save(obj, f, *args, **kwargs):
        if fault.hits("torch.save", f):
            # what a full disk leaves: the start of the file
            pathlib.Path(f).write_bytes(b"PK\x03\x04 partial")
            if fault.hidden:
                raise RuntimeError(TORCH_FULL_DISK)
            raise fault.error(named=False)  # a failed write() names no file
        return real["torch.save"](obj, f, *args, **kwargs)

    def write_text(self, data, *args, **kwargs):
        if fault.hits("write_text", self):
            real["write_text"](self, data[: len(data) // 2])
            raise fault.error(named=False)
        return real["write_text"](self, data, *args, **kwargs)

    def path_open(self, mode="r", *args, **kwargs):
        if "a" in mode and fault.hits("append", self):
            raise fault.error(named=False)
        if fault.fired and fault.hidden and self.name.startswith(".grpo_ds-write-probe"):
            raise fault.error(self)  # the disk is still full
        return real["open"](self, mode, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        if fault.hits("mkdir", self):
            raise fault.error(self)
        return real["mkdir"](self, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        if fault.hits("os.rename", src):
            raise fault.error(src)
        return real["os.rename"](src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if fault.hits("os.replace", src):
            raise fault.error(src)
        return real["os.replace"](src, dst, *args, **kwargs)

    def copyfile(src, dst, *args, **kwargs):
        if fault.hits("deepspeed.copyfile", dst):
            raise fault.error(named=False)
        return real["copyfile"](src, dst, *args, **kwargs)

    def ds_open(file, mode="r", *args, **kwargs):
        if "w" in mode and fault.hits("deepspeed.open", file):
            raise fault.error(named=False)
        return open(file, mode, *args, **kwargs)

    patch(torch, "save", save)
    patch(pathlib.Path, "write_text", write_text)
    patch(pathlib.Path, "open", path_open)
    patch(pathlib.Path, "mkdir", mkdir)
    patch(os, "rename", rename)
    patch(os, "replace", replace)
    patch(ds_engine, "copyfile", copyfile)
    # DeepSpeed's engine module calls the builtin open
    patch(ds_engine, "open", ds_open, raising=False)
    return fault


def from_env(spec: str) -> Fault:
    writer, suffix, code, *nth = spec.split(":")
    return Fault(writer, suffix, getattr(errno, code), int(nth[0]) if nth else 1)


if __name__ == "__main__":
    import sys

    from grpo_ds.train import main

    install(from_env(os.environ["GRPO_DS_WRITE_FAULT"]))
    main(sys.argv[1:])
