"""The trainer and the rollout ranks of a split placement, over process groups of their own.

Split placement (rollout.placement "split", grpo_ds.config.placement) launches W ranks with one command, as ever, but
they form two worlds: the first W-K ranks are the trainer's process group (DeepSpeed's, the ZeRO-3 group), the last K
ranks the rollout ranks' own (vLLM's external launcher and the collection's collectives use it), so that neither side
ever waits in the other's collectives (DeepSpeed's checkpoint barriers, vLLM's tensor-parallel steps). Both are made
from one TCP store that the trainer's rank 0 serves at MASTER_PORT + 1. A third group, the bridge, holds the trainer's
rank 0 (bridge rank 0) and the rollout ranks (bridge ranks 1..K): batches of samples and control messages travel
between the trainer's rank 0 and the first rollout rank, point to point; weights travel from the trainer's rank 0 to
every rollout rank, bucket by bucket (one bucket alive), by broadcast. Gloo on a CPU, NCCL on GPUs.

Every transfer waits at most ``timeout_s``; past it the run stops with one line that names the side that stalled
(``Stalled``), and a peer that died ends the wait at once, with a line that says so. The process groups are built
directly on the store (torch's ProcessGroupGloo / ProcessGroupNCCL), not registered as torch.distributed groups: the
bridge's members are in different default worlds.
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

STORE_PORT_OFFSET = 1  # the store of a split launch: MASTER_PORT + this, served by the trainer's rank 0
START_TIMEOUT_S = 1800.0  # the start-up's waits: one side loads a model (vLLM compiles) while the other waits


class Stalled(RuntimeError):
    """A transfer between the trainer and the rollout ranks that timed out or lost its peer. Its text is one line."""


def store_address() -> tuple[str, int]:
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")) + STORE_PORT_OFFSET


def open_store(serve: bool, timeout_s: float) -> torch.distributed.Store:
    """The split launch's TCP store: served by the trainer's rank 0, joined by every rollout rank."""
    host, port = store_address()
    return torch.distributed.TCPStore(host, port, None, serve, timeout=datetime.timedelta(seconds=timeout_s),
                                      wait_for_workers=False)


def _process_group(store, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float):
    prefixed = torch.distributed.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
    return torch.distributed.ProcessGroupGloo(prefixed, rank, size, timeout)


class Bridge:
    """One member of the bridge group. ``rank`` 0 is the trainer's rank 0, 1..K the rollout ranks in order; objects
    travel between ranks 0 and 1, weights from rank 0 to all."""

    TRAINER, ROLLOUT_LEAD = 0, 1

    def __init__(self, store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.size, self.device, self.timeout_s = rank, size, device, timeout_s
        self._group = _process_group(store, "bridge", rank, size, device, max(timeout_s, START_TIMEOUT_S))
        self._starting = False

    @contextmanager
    def starting(self) -> Iterator[None]:
        """The start-up's transfers wait up to START_TIMEOUT_S (a model loading on the other side), not
        rollout.transfer_timeout_s."""
        self._starting = True
        try:
            yield
        finally:
            self._starting = False

    # ---- waiting, with the side named
    def _wait(self, work, what: str, peer: str) -> None:
        limit = START_TIMEOUT_S if self._starting else self.timeout_s
        try:
            work.wait(datetime.timedelta(seconds=limit))
        except RuntimeError as err:
            text = str(err).lower()
            if "timed out" in text or "timeout" in text:
                within = f"the start-up's {limit:g} s" if self._starting else \
                    f"rollout.transfer_timeout_s = {limit:g} s"
                raise Stalled(f"the {peer} stalled: no {what} within {within}") from None
            raise Stalled(f"the {peer} went away while this side waited for {what} ({str(err).splitlines()[0]})"
                          ) from None

    def _peer(self, rank: int) -> str:
        return "trainer" if rank == self.TRAINER else "rollout ranks"

    # ---- objects, point to point
    def send_object(self, obj: Any, dst: int, what: str) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self._wait(self._group.send([size], dst, 0), what, self._peer(dst))
        self._wait(self._group.send([payload], dst, 1), what, self._peer(dst))

    def recv_object(self, src: int, what: str) -> Any:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._wait(self._group.recv([size], src, 0), what, self._peer(src))
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._group.recv([payload], src, 1), what, self._peer(src))
        return pickle.loads(payload.cpu().numpy().tobytes())

    # ---- objects and weights, broadcast from the trainer
    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self._wait(self._group.broadcast(tensor, self.TRAINER), what,
                   "trainer" if self.rank != self.TRAINER else "rollout ranks")

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """The trainer's ``obj`` on every member (the others pass None)."""
        if self.rank == self.TRAINER:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size, what)
        if self.rank != self.TRAINER:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload, what)
        return obj if self.rank == self.TRAINER else pickle.loads(payload.cpu().numpy().tobytes())

    def send_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
        """The trainer's rank 0: every (name, tensor) to every rollout rank, in buckets of about ``bucket_bytes``
        (each bucket one flat buffer, the only one alive); returns the bytes sent."""
        sent, bucket, size = 0, [], 0
        for name, tensor in named_tensors:
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            bucket.append((name, tuple(tensor.shape), tensor.dtype, flat.to(self.device, copy=True)))
            size += flat.numel()
            if size >= bucket_bytes:
                sent += self._send_bucket(bucket)
                bucket, size = [], 0
        sent += self._send_bucket(bucket)
        self.broadcast_object(None, "the end of the weights")
        return sent

    def _send_bucket(self, bucket: list) -> int:
        if not bucket:
            return 0
        self.broadcast_object([(name, shape, dtype) for name, shape, dtype, _ in bucket], "weights")
        flat = torch.cat([data for *_, data in bucket])
        self._broadcast(flat, "weights")
        return flat.numel()

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A rollout rank: the trainer's (name, tensor) pairs, bucket by bucket, until the end marker (consume it to
        the end)."""
        while (header := self.broadcast_object(None, "weights")) is not None:
            sizes = [_bytes(shape, dtype) for _, shape, dtype in header]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._broadcast(flat, "weights")
            for (name, shape, dtype), part in zip(header, flat.split(sizes), strict=True):
                yield name, part.view(dtype).view(shape)


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()
