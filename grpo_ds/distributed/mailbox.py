"""The rollout side of the bridge with its waits in threads of their own: what continuous generation
(grpo_ds.step.continuous) needs to keep decoding while messages come and go.

The batch-by-batch rollout ranks (grpo_ds.step.schedule.serve_rollouts) wait for each go-ahead and
each send in turn, with the engine idle. A continuous engine must not: the go-ahead of the next step
(and the weights that come with it) arrives while it decodes, and a step's batch goes up while it
decodes the next steps. So:

- ``Inbox`` receives the trainer's broadcasts (GoAhead, Stop) in a thread and queues them; the
  decode loop ``poll``s between two decode steps, and blocks only when it has nothing to decode.
  A GoAhead that brings weights stops the thread until the loop has taken them (``weights``) in
  its own thread, bucket by bucket, between two decode steps: never more than one bucket alive.
- ``Outbox`` sends the first rollout rank's batches up in a thread, in order (the bridge sends up
  in a process group of its own, so a send and a broadcast may wait at the same time); on the
  other rollout ranks, when there are several, it sends their shares of each step to the first
  (``Bridge.send_share``).
- On the first of several rollout ranks, the ``Inbox`` also receives the other rollout ranks'
  shares, each in a thread of its own, into the same queue: the decode loop waits for whatever
  comes first, a go-ahead or a share.

A transfer that fails in a thread (a stalled or vanished trainer: grpo_ds.distributed.bridge) is
raised in the decode loop at its next ``poll`` or ``check``, as the blocking receive would have.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch

from grpo_ds.distributed.bridge import Bridge
from grpo_ds.distributed.messages import GoAhead, Message, Share, Stop


class Inbox:
    """The trainer's GoAhead and Stop messages for one rollout rank, received in a thread; with
    ``peers`` (bridge ranks of the other rollout ranks, on the first of them), their Shares too,
    a thread each, until each sends its last (a Share of no step)."""

    def __init__(self, bridge: Bridge, peers: tuple[int, ...] = ()) -> None:
        self._bridge = bridge
        self._queue: queue.Queue = queue.Queue()
        self._taken = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="grpo_ds-inbox", daemon=True)
        self._thread.start()
        self._shares = [
            threading.Thread(
                target=self._receive_shares, args=(peer,), name=f"grpo_ds-share-{peer}", daemon=True
            )
            for peer in peers
        ]
        for thread in self._shares:
            thread.start()

    def _receive_shares(self, peer: int) -> None:
        try:
            while (share := self._bridge.receive_share(peer, Share)).step is not None:
                self._queue.put(share)
        except BaseException as err:  # raised in the decode loop, at its next poll
            self._queue.put(err)

    def close(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for every other rollout rank's last share."""
        for thread in self._shares:
            thread.join(timeout_s)

    def _receive(self) -> None:
        try:
            while True:
                message = self._bridge.receive(GoAhead, Stop)
                self._queue.put(message)
                if isinstance(message, Stop):
                    return
                if message.version is not None:  # the loop takes the weights that follow
                    self._taken.wait()
                    self._taken.clear()
        except BaseException as err:  # raised in the decode loop, at its next poll
            self._queue.put(err)

    def poll(self, block: bool) -> Message | None:
        """The next message; None when none has come and ``block`` is false."""
        try:
            item = self._queue.get(block=block)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights of the GoAhead just polled, bucket by bucket (consume to the end)."""
        yield from self._bridge.receive_weights()
        self._taken.set()


class Outbox:
    """Messages sent in order in a thread by ``send``: the first rollout rank's up to the trainer
    (``Bridge.send``), another rollout rank's shares to the first (``Bridge.send_share``)."""

    def __init__(self, send: Callable[[Message], None]) -> None:
        self._send_one = send
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._send, name="grpo_ds-outbox", daemon=True)
        self._thread.start()

    def _send(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._send_one(message)
            except BaseException as err:  # raised in the decode loop, at its next check
                self._error = err
                return

    def put(self, message: Message) -> None:
        self.check()
        self._queue.put(message)

    def check(self) -> None:
        """Raise what failed a send."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Send what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()
        self.check()
