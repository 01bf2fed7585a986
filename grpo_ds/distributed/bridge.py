"""The trainer and the rollout ranks of a split placement, over process groups of their own.

Split placement (rollout.placement "split", grpo_ds.config.placement) launches W ranks with one
command, as ever, but they form two worlds: the first W-K ranks are the trainer's process group
(DeepSpeed's, the ZeRO-3 group), the last K ranks the rollout ranks' own (vLLM's external launcher
and the collection's collectives use it), so that neither side ever waits in the other's
collectives (DeepSpeed's checkpoint barriers, vLLM's tensor-parallel steps). Both are made from one
TCP store that the trainer's rank 0 serves at MASTER_PORT + 1. A third group, the bridge, holds the
trainer's rank 0 (bridge rank 0) and the rollout ranks (bridge ranks 1..K). What travels over it is
typed (grpo_ds.distributed.messages: one codec, with a version):

- up, from the first rollout rank to the trainer's rank 0, point to point (``send``) in a group of
  the two alone: the rollout engine's ``Layout`` at the start, then one ``Batch`` of samples per
  step;
- down, from the trainer's rank 0 to every rollout rank, by broadcast (``broadcast``): ``Start``,
  then a ``GoAhead`` per step, and ``Stop`` at the end or on a preemption;
- the weights, down, after a GoAhead that says so (``send_weights``): per bucket a ``WeightBucket``
  naming its tensors, then the bucket as one flat buffer of raw bytes (one bucket alive), and a
  ``WeightsEnd`` after the last;
- sideways, under continuous generation on several rollout ranks (``send_share``,
  ``receive_share``): each rollout rank after the first sends its ended groups of a step (a
  ``Share``) to the first, which puts the step's batch together, point to point in a group of the
  two alone.

Before any of it, before anything loads, the trainer's rank 0 puts its ``Verdict`` in the store
(go on, finished, or a refusal) and the rollout ranks wait for it, so that a run that ends there
ends on every rank at once. Once each side has opened its parts (models, engine, reward workers),
and before the bridge is built, the two sides meet in the store the same way: each rollout rank
says whether it started or refused (``publish_rollout_start``), the trainer's rank 0 waits for all
of them and says whether training starts (``meet_rollout_ranks``), or says its own side's refusal
(``publish_trainer_start``); a refusal on either side ends every rank with one line and exit 2.

Each member takes its messages with one ``receive(kinds)``, which refuses any other kind, version
or malformed payload with one line naming the side that sent it (BridgeError). Gloo on a CPU, NCCL
on GPUs.

Every transfer waits at most ``timeout_s`` (the start-up's, Layout and Start, START_TIMEOUT_S);
past it the run stops with one line that names the side that stalled (``Stalled``), and a peer
that died ends the wait at once, with a line that says so. The process groups are built directly
on the store (torch's ProcessGroupGloo / ProcessGroupNCCL), not registered as torch.distributed
groups: the bridge's members are in different default worlds.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from grpo_ds.distributed import messages
from grpo_ds.distributed.messages import (
    BridgeError,
    Message,
    WeightBucket,
    WeightsEnd,
    decode,
    encode,
)

# the store of a split launch: MASTER_PORT + this, served by the trainer's rank 0
STORE_PORT_OFFSET = 1
# the start-up's waits: one side loads a model (vLLM compiles) while the other waits
START_TIMEOUT_S = 1800.0


class Stalled(BridgeError):
    """A transfer between the trainer and the rollout ranks that timed out or lost its peer. Its
    text is one line."""


# ---------------------------------------------------------------------------------- the verdict

VERDICT_KEY = "verdict"  # the launch's own store: no other run shares it


@dataclass(frozen=True)
class Verdict:
    """What the run does, decided by the trainer's rank 0 before any model loads, for the rollout
    ranks to do too: "go", "finished" (the run folder holds a finished run: nothing to do) or
    "refused" (a refusal: ``where``, ``what``, ``fix`` of its UserError; "refused-unprinted" where
    the rank that refused has not printed it). The sides' meeting after their parts open says "go"
    or a refusal the same way."""

    kind: str
    where: str = ""
    what: str = ""
    fix: str = ""

    @staticmethod
    def refusal(err: Exception, printed: bool = True) -> Verdict:
        """A UserError's verdict; ``printed``: whether the rank that refused printed its line."""
        return Verdict("refused" if printed else "refused-unprinted", err.where, err.what, err.fix)

    @property
    def refused(self) -> bool:
        return self.kind.startswith("refused")


def publish_verdict(store, verdict: Verdict, rollout_ranks: int) -> None:
    """The trainer's rank 0: the verdict into the launch's store. When the run ends here it waits
    until every rollout rank has read it (the store ends with this process)."""
    _put(store, VERDICT_KEY, verdict)
    if verdict.refused or verdict.kind == "finished":
        read = [f"{VERDICT_KEY}/read/{r}" for r in range(rollout_ranks)]
        _store_wait(store, read, "the rollout ranks", "to read that the run ends")


def await_verdict(store, rank: int) -> Verdict:
    """A rollout rank: the trainer's verdict, before it loads anything (``rank``: its place among
    the rollout ranks)."""
    return _read(store, VERDICT_KEY, rank, "to decide whether the run goes on")


# ---- the meeting after both sides have opened their parts
STARTED_KEY = "started"
MEETING_POLL_S = 0.1


def publish_rollout_start(store, rank: int, verdict: Verdict) -> None:
    """A rollout rank (``rank``: its place among them), its parts open or refused."""
    _put(store, f"{STARTED_KEY}/rollout/{rank}", verdict)


def meet_rollout_ranks(store, rollout_ranks: int) -> Verdict:
    """The trainer's rank 0, its parts open: every rollout rank's start, then the word for them
    (go, or the first of their refusals, which the others then read); returns that word."""
    keys = [f"{STARTED_KEY}/rollout/{r}" for r in range(rollout_ranks)]
    _store_wait(store, keys, "rollout ranks", "to open their parts")
    starts = [_get(store, key) for key in keys]
    word = next((v for v in starts if v.refused), Verdict("go"))
    publish_trainer_start(store, word, rollout_ranks)
    return word


def publish_trainer_start(store, verdict: Verdict, rollout_ranks: int) -> None:
    """The trainer's rank 0: whether training starts. On a refusal it waits until each rollout rank
    has read it or has refused itself (the store ends with this process)."""
    _put(store, f"{STARTED_KEY}/trainer", verdict)
    if not verdict.refused:
        return
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = set(range(rollout_ranks))
    while waiting and time.monotonic() < deadline:
        for r in list(waiting):
            own = f"{STARTED_KEY}/rollout/{r}"
            if store.check([f"{STARTED_KEY}/trainer/read/{r}"]) or (
                store.check([own]) and _get(store, own).refused
            ):
                waiting.discard(r)
        time.sleep(MEETING_POLL_S)


def await_trainer_start(store, rank: int) -> Verdict:
    """A rollout rank, its parts open: the trainer's word on whether training starts."""
    return _read(store, f"{STARTED_KEY}/trainer", rank, "to open its parts")


def _put(store, key: str, verdict: Verdict) -> None:
    store.set(key, json.dumps(dataclasses.asdict(verdict)))


def _get(store, key: str) -> Verdict:
    return Verdict(**json.loads(store.get(key)))


def _read(store, key: str, rank: int, what: str) -> Verdict:
    """A rollout rank (``rank``: its place among them): the trainer's word under ``key``, once it
    is there, then marked read (key/read/rank) for the trainer, which may be waiting to leave."""
    _store_wait(store, [key], "trainer", what)
    verdict = _get(store, key)
    store.set(f"{key}/read/{rank}", "1")
    return verdict


def _store_wait(store, keys: list[str], peer: str, what: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=START_TIMEOUT_S))
    except RuntimeError as err:  # a timeout, or the store's server gone
        raise Stalled(
            f"the {peer} stalled: no word within the start-up's {START_TIMEOUT_S:g} s {what} "
            f"({str(err).splitlines()[0]})"
        ) from None


def store_address() -> tuple[str, int]:
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(
        os.environ.get("MASTER_PORT", "29500")
    ) + STORE_PORT_OFFSET


def open_store(serve: bool, timeout_s: float) -> torch.distributed.Store:
    """The split launch's TCP store: served by the trainer's rank 0, joined by every rollout
    rank."""
    host, port = store_address()
    return torch.distributed.TCPStore(
        host,
        port,
        None,
        serve,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _process_group(
    store, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float
):
    prefixed = torch.distributed.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
    return torch.distributed.ProcessGroupGloo(prefixed, rank, size, timeout)


class Bridge:
    """One member of the bridge group: ``rank`` 0 is the trainer's rank 0, 1..K the rollout ranks in
    order. Messages (grpo_ds.distributed.messages) travel up, from the first rollout rank to the
    trainer (``send``), and down, from the trainer to every rollout rank (``broadcast``); each
    member takes its own with ``receive``. Weights travel down, bucket by bucket."""

    TRAINER, ROLLOUT_LEAD = 0, 1

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        shares: bool = False,
    ) -> None:
        self.rank, self.size, self.device, self.timeout_s = rank, size, device, timeout_s
        self._group = _process_group(
            store, "bridge", rank, size, device, max(timeout_s, START_TIMEOUT_S)
        )
        # the messages up travel in a group of their own (the trainer's rank 0 and the first
        # rollout rank), so that a send up and a broadcast down may wait at the same time, each in
        # a thread of its own (continuous generation: grpo_ds.distributed.mailbox)
        self._up = (
            _process_group(store, "bridge-up", rank, 2, device, max(timeout_s, START_TIMEOUT_S))
            if rank in (self.TRAINER, self.ROLLOUT_LEAD)
            else None
        )
        # the side this member waits for
        self._peer = "rollout ranks" if rank == self.TRAINER else "trainer"
        # ``shares`` (continuous generation on several rollout ranks): each rollout rank after the
        # first sends its shares of a step to the first, in a group of the two alone (the first is
        # its member 0), so that the first receives from each in a thread of its own
        self._shares: dict[int, object] = {}
        if shares and rank >= self.ROLLOUT_LEAD:
            lead = rank == self.ROLLOUT_LEAD
            for peer in range(self.ROLLOUT_LEAD + 1, size) if lead else [rank]:
                self._shares[peer] = _process_group(
                    store,
                    f"bridge-share-{peer}",
                    0 if lead else 1,
                    2,
                    device,
                    max(timeout_s, START_TIMEOUT_S),
                )

    # ---- messages
    def send(self, message: Message) -> None:
        """The first rollout rank: ``message`` up, to the trainer's rank 0."""
        if self.rank != self.ROLLOUT_LEAD:
            raise ValueError(
                f"bridge rank {self.rank} sends nothing up: only the first rollout "
                "rank does (the trainer broadcasts)"
            )
        self._send_bytes(encode(message), type(message), up=True)

    def broadcast(self, message: Message) -> None:
        """The trainer's rank 0: ``message`` down, to every rollout rank."""
        if self.rank != self.TRAINER:
            raise ValueError(f"bridge rank {self.rank} broadcasts nothing: only the trainer does")
        self._send_bytes(encode(message), type(message), up=False)

    def receive(self, *kinds: type) -> Message:
        """The next message for this member, one of ``kinds``: the trainer's rank 0 takes what the
        first rollout rank sends, a rollout rank what the trainer broadcasts. A message that is not
        one of ``kinds`` is refused (BridgeError, one line naming the sender)."""
        up, what = self.rank == self.TRAINER, messages.what(kinds)
        start_up = any(k.START_UP for k in kinds)
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._carry(size, up, what, start_up, tag=0)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._carry(payload, up, what, start_up, tag=1)
        return decode(payload.cpu().numpy().tobytes(), f"the {self._peer}", kinds)

    def send_share(self, message: Message) -> None:
        """A rollout rank after the first: ``message`` (a Share) to the first rollout rank."""
        group, name = self._shares[self.rank], "first rollout rank"
        data = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        for tag, tensor in enumerate((size, data)):
            self._pair(lambda t=tensor, tag=tag: group.send([t], 0, tag), message.WHAT, name)

    def receive_share(self, peer: int, *kinds: type) -> Message:
        """The first rollout rank: the next message from bridge rank ``peer`` (a rollout rank after
        the first), one of ``kinds``."""
        group, name = self._shares[peer], f"rollout rank {peer - 1}"
        what = messages.what(kinds)
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._pair(lambda: group.recv([size], 1, 0), what, name)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._pair(lambda: group.recv([payload], 1, 1), what, name)
        return decode(payload.cpu().numpy().tobytes(), f"the {name}", kinds)

    def _pair(self, post, what: str, peer: str) -> None:
        """One transfer between two rollout ranks (``post`` starts it), waited for as any other,
        a failure naming ``peer``."""
        try:
            work = post()
        except RuntimeError as err:
            raise self._gone(err, what, peer) from None
        self._wait(work, what, False, peer)

    def _send_bytes(self, payload: bytes, kind: type, up: bool) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        self._carry(size, up, kind.WHAT, kind.START_UP, tag=0)
        self._carry(data, up, kind.WHAT, kind.START_UP, tag=1)

    def _carry(
        self, tensor: torch.Tensor, up: bool, what: str, start_up: bool = False, tag: int = 0
    ) -> None:
        """``tensor`` up (from the first rollout rank to the trainer's rank 0, point to point, with
        ``tag``) or down (broadcast from the trainer's rank 0 to every rollout rank)."""
        try:  # a peer already gone fails the transfer as it is posted, not only in its wait
            if not up:
                work = self._group.broadcast(tensor, self.TRAINER)
            elif self.rank == self.TRAINER:
                work = self._up.recv([tensor], self.ROLLOUT_LEAD, tag)
            else:
                work = self._up.send([tensor], self.TRAINER, tag)
        except RuntimeError as err:
            raise self._gone(err, what) from None
        self._wait(work, what, start_up)

    # ---- weights, down
    def send_weights(
        self, named_tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> int:
        """The trainer's rank 0: every (name, tensor) to every rollout rank, in buckets of about
        ``bucket_bytes`` (each bucket one flat buffer, the only one alive); returns the bytes
        sent."""
        sent, bucket, size = 0, [], 0
        for name, tensor in named_tensors:
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            bucket.append(
                (name, tuple(tensor.shape), tensor.dtype, flat.to(self.device, copy=True))
            )
            size += flat.numel()
            if size >= bucket_bytes:
                sent += self._send_bucket(bucket)
                bucket, size = [], 0
        sent += self._send_bucket(bucket)
        self.broadcast(WeightsEnd())
        return sent

    def _send_bucket(self, bucket: list) -> int:
        if not bucket:
            return 0
        self.broadcast(WeightBucket([(name, shape, dtype) for name, shape, dtype, _ in bucket]))
        flat = torch.cat([data for *_, data in bucket])
        self._carry(flat, False, WeightBucket.WHAT)
        return flat.numel()

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A rollout rank: the trainer's (name, tensor) pairs, bucket by bucket, until WeightsEnd
        (consume it to the end)."""
        while isinstance(bucket := self.receive(WeightBucket, WeightsEnd), WeightBucket):
            sizes = [_bytes(shape, dtype) for _, shape, dtype in bucket.tensors]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._carry(flat, False, WeightBucket.WHAT)
            for (name, shape, dtype), part in zip(bucket.tensors, flat.split(sizes), strict=True):
                yield name, part.view(dtype).view(shape)

    # ---- waiting, with the side named
    def _wait(self, work, what: str, start_up: bool, peer: str | None = None) -> None:
        limit = START_TIMEOUT_S if start_up else self.timeout_s
        peer = peer or self._peer
        try:
            work.wait(datetime.timedelta(seconds=limit))
        except RuntimeError as err:
            text = str(err).lower()
            if "timed out" in text or "timeout" in text:
                within = (
                    f"the start-up's {limit:g} s"
                    if start_up
                    else f"rollout.transfer_timeout_s = {limit:g} s"
                )
                raise Stalled(f"the {peer} stalled: no {what} within {within}") from None
            raise self._gone(err, what, peer) from None

    def _gone(self, err: RuntimeError, what: str, peer: str | None = None) -> Stalled:
        return Stalled(
            f"the {peer or self._peer} went away while this side waited for {what} "
            f"({str(err).splitlines()[0]})"
        )


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()
