"""grpo_ds.distributed.mailbox over a real bridge (gloo): the rollout side's receive and send in
threads of their own, as continuous generation drives them. A go-ahead and its weights arrive while
the loop is busy and a batch goes up while the trainer broadcasts; the faults of an update in flight
end with one line naming the side: weights that stop coming (a stalled trainer), a trainer process
that dies mid-update, a rollout process that dies mid-update."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from grpo_ds.distributed.bridge import Bridge, Stalled, open_store
from grpo_ds.distributed.mailbox import Inbox, Outbox
from grpo_ds.distributed.messages import Batch, GoAhead, Share, Stop, WeightBucket
from tests.distributed.test_bridge import TIMEOUT_S, _bits, _bridge, _together, _weights
from tests.launch import free_port


def test_a_go_ahead_and_its_weights_arrive_while_the_loop_is_busy_and_a_batch_goes_up():
    weights = _weights()
    trainer, lead = _bridge(2)

    def trainer_side():
        trainer.broadcast(GoAhead(2, 1))
        trainer.send_weights(iter(weights.items()), 64)  # several buckets
        got = trainer.receive(Batch)  # sent while the rollout side took the weights
        trainer.broadcast(Stop([{"step": 1}]))
        return got

    def rollout_side():
        inbox, outbox = Inbox(lead), Outbox(lead.send)
        outbox.put(Batch(1, 0, None, {}))  # goes up in its thread
        time.sleep(0.2)  # decoding: the go-ahead waits in the queue
        message = inbox.poll(block=True)
        assert message == GoAhead(2, 1)
        taken = [(n, t.clone()) for n, t in inbox.weights()]
        stop = inbox.poll(block=True)
        outbox.close()
        return taken, stop, inbox.poll(block=False)

    batch, (taken, stop, nothing) = _together(trainer_side, rollout_side)
    assert batch == Batch(1, 0, None, {})
    assert [n for n, _ in taken] == list(weights)
    assert all(_bits(t) == _bits(weights[n]) for n, t in taken)
    assert stop == Stop([{"step": 1}]) and nothing is None


def test_the_other_rollout_ranks_shares_reach_the_first_while_the_trainer_broadcasts():
    trainer, lead, *others = _bridge(4, shares=True)

    def trainer_side():
        trainer.broadcast(GoAhead(1, None))
        trainer.broadcast(Stop([]))

    def other_side(member: Bridge, rank: int):
        inbox, outbox = Inbox(member), Outbox(member.send_share)
        assert inbox.poll(block=True) == GoAhead(1, None)
        outbox.put(Share(1, rank, [rank], 5, 10, 0.5))  # goes in its thread
        assert inbox.poll(block=True) == Stop([])
        outbox.put(Share(None, rank))  # its last
        outbox.close()

    def lead_side():
        inbox = Inbox(lead, peers=(2, 3))
        got = [inbox.poll(block=True) for _ in range(4)]  # the go-ahead, 2 shares, the stop
        inbox.close(TIMEOUT_S)  # every other rank sent its last share
        return got, inbox.poll(block=False)

    _, (got, nothing), *_ = _together(
        trainer_side,
        lead_side,
        *(lambda m=m, r=r: other_side(m, r) for r, m in enumerate(others, 1)),
    )
    # the go-ahead first of the trainer's; a share may come before it (the other rank took the
    # broadcast at the same moment), which the decode loop keeps for the step
    trainers = [m for m in got if not isinstance(m, Share)]
    assert trainers == [GoAhead(1, None), Stop([])]
    assert sorted((m.rank, m.rollouts) for m in got if isinstance(m, Share)) == [(1, [1]), (2, [2])]
    assert nothing is None  # the last shares end the lead's threads, not its queue


def test_a_rollout_rank_whose_share_never_comes_stalls_the_first_in_one_line():
    trainer, lead, other = _bridge(3, timeout_s=0.3, shares=True)
    with pytest.raises(Stalled) as info:  # what the lead's share thread raises at its next poll
        lead.receive_share(2, Share)
    assert str(info.value) == (
        "the rollout rank 1 stalled: no share of a batch within rollout.transfer_timeout_s = 0.3 s"
    )


def test_weights_that_stop_coming_mid_update_stall_the_rollout_side_in_one_line():
    trainer, lead = _bridge(2, timeout_s=0.3)

    def trainer_side():
        trainer.broadcast(GoAhead(2, 1))
        trainer.broadcast(WeightBucket([("w", (2,), torch.float32)]))
        time.sleep(2)  # the bucket itself never comes

    def rollout_side():
        inbox = Inbox(lead)
        assert inbox.poll(block=True) == GoAhead(2, 1)
        with pytest.raises(Stalled) as info:
            list(inbox.weights())
        return str(info.value)

    _, said = _together(trainer_side, rollout_side)
    assert said == "the trainer stalled: no weights within rollout.transfer_timeout_s = 0.3 s"


def _member(rank: int, port: int, die_after_buckets: int, ready) -> None:
    """A bridge member in a process of its own (rank 0 the trainer, serving the store; rank 1 the
    rollout lead), which exits at once in the middle of an update: the trainer after sending
    ``die_after_buckets`` buckets, the rollout rank after taking them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    bridge = Bridge(open_store(rank == 0, 30), rank, 2, torch.device("cpu"), 30)
    ready.set()
    weights = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}  # a bucket each at 1 KiB
    if rank == 0:
        bridge.broadcast(GoAhead(2, 1))
        sent = 0
        for name, tensor in weights.items():
            if sent == die_after_buckets:
                os._exit(0)
            bridge.broadcast(WeightBucket([(name, (256,), torch.float32)]))
            bridge._carry(tensor.view(torch.uint8), False, WeightBucket.WHAT)
            sent += 1
    inbox = Inbox(bridge)
    inbox.poll(block=True)
    for taken, _ in enumerate(inbox.weights(), 1):
        if taken == die_after_buckets:
            os._exit(0)


def _survivor(rank: int, port: int, ready) -> str:
    """The other member, in this process: the line its wait ends with when the peer dies."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    bridge = Bridge(open_store(rank == 0, 30), rank, 2, torch.device("cpu"), 30)
    ready.wait(30)
    began = time.monotonic()
    with pytest.raises(Stalled) as info:
        if rank == 0:
            bridge.broadcast(GoAhead(2, 1))
            weights = ((f"w{i}", torch.full((256,), float(i))) for i in range(8))
            bridge.send_weights(weights, 1024)
        else:
            inbox = Inbox(bridge)
            inbox.poll(block=True)
            list(inbox.weights())
    assert time.monotonic() - began < 10  # at once, not after the transfer timeout of 30 s
    return str(info.value)


@pytest.mark.parametrize("dies", ["trainer", "rollout rank"])
def test_a_peer_that_dies_mid_update_ends_the_others_wait_at_once_in_one_line(dies, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    dying_rank = 0 if dies == "trainer" else 1
    child = context.Process(target=_member, args=(dying_rank, port, 3, ready))
    if dying_rank == 0:  # the trainer serves the store: it starts first
        child.start()
        said = _survivor(1, port, ready)
    else:
        child.start()
        said = _survivor(0, port, ready)
    child.join(TIMEOUT_S)
    assert "\n" not in said
    peer = "the trainer" if dies == "trainer" else "the rollout ranks"
    assert said.startswith(f"{peer} went away while this side waited for weights"), said


def _join_and_leave(rank: int, port: int, ready) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    Bridge(open_store(rank == 0, 30), rank, 2, torch.device("cpu"), 30)
    ready.set()
    os._exit(0)


def test_a_transfer_posted_after_the_peer_died_is_one_line_too(monkeypatch):
    """The trainer asks for a batch from a rollout process that is already gone: gloo fails the
    receive as it is posted (not in its wait), and that too is the one line naming the side."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_join_and_leave, args=(1, port, ready))
    child.start()
    os.environ.update(MASTER_PORT=str(port))
    bridge = Bridge(open_store(True, 30), 0, 2, torch.device("cpu"), 30)
    ready.wait(30)
    child.join(TIMEOUT_S)
    time.sleep(0.5)  # the connection's close has reached this side
    with pytest.raises(Stalled) as info:
        bridge.receive(Batch)
    said = str(info.value)
    assert "\n" not in said and said.startswith(
        "the rollout ranks went away while this side waited for batch of samples"
    ), said
