"""The bridge of split placement (grpo_ds/distributed/bridge.py) and the typed messages that cross
it (grpo_ds/distributed/messages.py), without a launcher: the members of a real bridge (gloo) run in
threads of this process, on one torch HashStore.

- every kind of message round-trips through the codec, and up and down a real bridge (to every
  rollout rank);
- the weights arrive bit-exact, bucket by bucket;
- what a side does not expect (another kind, another version, bytes that are not a message) is
  refused with one line that names the side that sent it;
- a side that sends nothing stalls the other, which says so in one line naming it.
"""

from __future__ import annotations

import pickle
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from grpo_ds.distributed.bridge import (
    Bridge,
    Stalled,
    Verdict,
    await_verdict,
    publish_verdict,
)
from grpo_ds.distributed.messages import (
    BRIDGE_VERSION,
    KINDS,
    MAGIC,
    Batch,
    BridgeError,
    GoAhead,
    Layout,
    Preemption,
    Share,
    Start,
    Stop,
    WeightBucket,
    WeightsEnd,
    decode,
    encode,
)

# one or more of each kind, with every optional field both set and unset
EXAMPLES = [
    Layout({"qkv_proj": ["q_proj", "k_proj", "v_proj"]}),
    Layout(None),
    Start(3, {"epoch": 1, "position": 8, "order": [2, 0, 1]}, True),
    Start(1, None, False),
    GoAhead(4, 2),
    GoAhead(5, None),
    Batch(
        2,
        1,
        {"samples": "opaque to the bridge", "ids": [[1, 2], [3]]},
        {"position": 8},
        "SIGTERM",
        1.5,
        0.25,
        [["rollout", 1.0, 2.0], ["send", 2.0, 2.5]],
    ),
    Batch(1, 0, None, {}),
    Share(3, 1, {"rollouts": "opaque to the bridge"}, 12, 96, 0.25),
    Share(None, 2),
    Stop([{"step": 1, "loss": 0.5}]),
    Stop([], Preemption("SIGTERM", 3, 6, "/run/checkpoints/step_3")),
    Stop([], Preemption("SIGUSR1", 2, 6, None)),
    WeightBucket([("layers.0.w", (2, 3), torch.bfloat16), ("b", (), torch.float32)]),
    WeightsEnd(),
]
UP = [m for m in EXAMPLES if isinstance(m, (Layout, Batch))]  # what the first rollout rank sends
DOWN = [m for m in EXAMPLES if isinstance(m, (Start, GoAhead, Stop))]  # what the trainer broadcasts
TIMEOUT_S = 5.0  # a test's transfers take milliseconds: a hang fails within seconds


def test_the_examples_hold_every_kind():
    assert {type(m) for m in EXAMPLES} == set(KINDS.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_through_the_codec(message):
    payload = encode(message)
    assert payload.startswith(MAGIC)
    assert decode(payload, "the trainer") == message
    assert decode(payload, "the trainer", (type(message), GoAhead)) == message


def test_only_messages_are_encoded():
    with pytest.raises(TypeError, match="dict is not a bridge message"):
        encode({"step": 1, "version": None})


# -------------------------------------------------------------------------------------- refusals


def _with_header(kind: str, body: bytes, version: int = BRIDGE_VERSION) -> bytes:
    """A payload as encode lays it out (the wire format of grpo_ds.distributed.messages)."""
    name = kind.encode("ascii")
    return MAGIC + struct.pack(">HB", version, len(name)) + name + body


def _refusal(payload: bytes, sender: str, *expected: type) -> str:
    with pytest.raises(BridgeError) as info:
        decode(payload, sender, expected)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{sender} sent ")
    return text


def test_another_version_is_refused_naming_the_sender():
    payload = encode(GoAhead(1, None))
    for version in (BRIDGE_VERSION + 1, 0):
        patched = MAGIC + struct.pack(">H", version) + payload[len(MAGIC) + 2 :]
        assert _refusal(patched, "the rollout ranks").startswith(
            f"the rollout ranks sent a message of version {version}; this side speaks version "
            f"{BRIDGE_VERSION} "
        )


def _raw(kind: str, body: Any) -> bytes:
    """A ``kind`` message whose body pickles ``body`` (encode pickles the tuple of its fields)."""
    return _with_header(kind, pickle.dumps(body))


GO = "GoAhead message whose"
MALFORMED = {  # what a sender's payload holds -> what the refusal says
    "empty": (b"", "sent 0 bytes that are not a bridge message"),
    "the old wire": (pickle.dumps({"step": 1}), "bytes that are not a bridge message"),
    "the magic alone": (MAGIC, "sent 14 bytes that are not a bridge message"),
    "unknown kind": (_raw("Resume", ()), "sent a message of unknown kind 'Resume'"),
    "cut short": (encode(GoAhead(1, None))[:-3], f"{GO} body does not decode"),
    "a field short": (_raw("GoAhead", (1,)), f"{GO} body is not its 2 fields"),
    "a dict body": (_raw("GoAhead", {"step": 1, "version": 2}), f"{GO} body is not its 2 fields"),
    "a str step": (_raw("GoAhead", ("1", None)), f"{GO} step is a str, not int"),
    "a bool step": (_raw("GoAhead", (True, None)), f"{GO} step is a bool"),
    "a str flag": (_raw("Start", (1, None, "yes")), "Start message whose data_changed is a str"),
    "a tuple preemption": (
        _raw("Stop", ([], ("SIGTERM", 1, 2, None))),
        "Stop message whose preempted is a tuple",
    ),
}


@pytest.mark.parametrize("payload, says", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_payload_is_refused_naming_the_sender(payload, says):
    assert says in _refusal(payload, "the trainer")


def test_a_float_field_takes_an_int():
    """A rollout rank's busy seconds are a sum over its phases, 0 when it timed none."""
    assert decode(encode(Batch(1, 0, None, {}, None, 0, 0)), "the rollout ranks").busy_s == 0


def test_a_message_of_another_kind_is_refused_naming_both_kinds():
    assert _refusal(encode(GoAhead(2, 1)), "the rollout ranks", Batch) == (
        "the rollout ranks sent a go-ahead (GoAhead) where this side expected a batch of samples "
        "(Batch)"
    )
    assert "expected a go-ahead or stop (GoAhead or Stop)" in _refusal(
        encode(Layout(None)), "the trainer", GoAhead, Stop
    )


# --------------------------------------------------------------------------------- a real bridge


def _bridge(size: int, timeout_s: float = TIMEOUT_S, shares: bool = False) -> list[Bridge]:
    """The ``size`` members of one bridge (the trainer's rank 0, then the rollout ranks): each joins
    the group in a thread, as the ranks of a launch do in their processes (``shares``: the rollout
    ranks' groups of continuous generation too)."""
    store = torch.distributed.HashStore()

    def member(rank: int) -> Bridge:
        return Bridge(store, rank, size, torch.device("cpu"), timeout_s, shares=shares)

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(member, range(size)))


def _together(*sides) -> list[Any]:
    """Each of ``sides`` (a function of no argument) in a thread of its own, at once: their results,
    or the first exception one raised."""
    with ThreadPoolExecutor(len(sides)) as pool:
        futures = [pool.submit(side) for side in sides]
        return [f.result(timeout=4 * TIMEOUT_S) for f in futures]


def test_messages_travel_up_and_down_to_every_rollout_rank():
    trainer, lead, other = _bridge(3)

    def trainer_side():
        got = [trainer.receive(type(m)) for m in UP]
        for message in DOWN:
            trainer.broadcast(message)
        return got

    def rollout_side(member: Bridge):
        if member is lead:
            for message in UP:
                member.send(message)
        return [member.receive(Start, GoAhead, Stop) for _ in DOWN]

    up, *down = _together(trainer_side, lambda: rollout_side(lead), lambda: rollout_side(other))
    assert up == UP
    assert down == [DOWN, DOWN]


def test_only_the_first_rollout_rank_sends_up_and_only_the_trainer_broadcasts():
    trainer, lead = _bridge(2)
    with pytest.raises(ValueError, match="only the first rollout rank"):
        trainer.send(GoAhead(1, None))
    with pytest.raises(ValueError, match="only the trainer"):
        lead.broadcast(Batch(1, 0, None, {}))


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    w[0, 0], w[0, 1] = float("nan"), -0.0  # bit-exact: a value-wise comparison would miss these
    return {
        "w": w,
        "w_t": w.t(),  # not contiguous
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(11, generator=g).to(torch.float16),
        "ids": torch.arange(-4, 5, dtype=torch.int64).reshape(3, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "bucket_bytes", [1, 64, 1 << 20], ids=["a tensor a bucket", "buckets", "one bucket"]
)
def test_weights_arrive_bit_exact_on_every_rollout_rank(bucket_bytes):
    weights = _weights()
    trainer, *rollout = _bridge(3)
    sent, *received = _together(
        lambda: trainer.send_weights(iter(weights.items()), bucket_bytes),
        *[lambda m=m: [(n, t.clone()) for n, t in m.receive_weights()] for m in rollout],
    )
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    for pairs in received:
        assert [n for n, _ in pairs] == list(weights)
        for name, tensor in pairs:
            assert (tensor.dtype, tensor.shape) == (weights[name].dtype, weights[name].shape), name
            assert _bits(tensor) == _bits(weights[name]), name


def test_a_refused_message_over_the_bridge_names_the_side_that_sent_it():
    trainer, lead = _bridge(2)

    def trainer_waits_for_a_batch():
        with pytest.raises(BridgeError) as info:
            trainer.receive(Batch)
        return str(info.value)

    def rollout_waits_for_a_go_ahead():
        with pytest.raises(BridgeError) as info:
            lead.receive(GoAhead, Stop)
        return str(info.value)

    up, _ = _together(trainer_waits_for_a_batch, lambda: lead.send(GoAhead(1, None)))
    assert up.startswith("the rollout ranks sent a go-ahead (GoAhead) where this side expected")
    _, down = _together(
        lambda: trainer.broadcast(Batch(1, 0, None, {})), rollout_waits_for_a_go_ahead
    )
    assert down.startswith("the trainer sent a batch of samples (Batch) where this side expected")
    # a payload of another version: what a rank running another grpo_ds would send
    batch = encode(Batch(1, 0, None, {}))
    newer = MAGIC + struct.pack(">H", BRIDGE_VERSION + 1) + batch[len(MAGIC) + 2 :]
    up, _ = _together(trainer_waits_for_a_batch, lambda: lead._send_bytes(newer, Batch, up=True))
    assert up.startswith(f"the rollout ranks sent a message of version {BRIDGE_VERSION + 1}; ")


def test_a_silent_side_stalls_the_other_with_one_line_naming_it():
    """Neither side sends: each waits out rollout.transfer_timeout_s, then says the other
    stalled."""
    trainer, lead = _bridge(2, timeout_s=0.2)

    def waits(member: Bridge, *kinds: type):
        with pytest.raises(Stalled) as info:
            member.receive(*kinds)
        return str(info.value)

    up, down = _together(lambda: waits(trainer, Batch), lambda: waits(lead, GoAhead, Stop))
    within = "within rollout.transfer_timeout_s = 0.2 s"
    assert up == f"the rollout ranks stalled: no batch of samples {within}"
    assert down == f"the trainer stalled: no go-ahead or stop {within}"


# ------------------------------------------------------------------------------------ the verdict


@pytest.mark.parametrize(
    "verdict",
    [
        Verdict("go"),
        Verdict("finished"),
        Verdict("refused", "run.name", "holds another run", "fix"),
    ],
    ids=["go", "finished", "refused"],
)
def test_every_rollout_rank_reads_the_trainers_verdict(verdict):
    """The verdict reaches each rollout rank whole; a run that ends there waits for both to read it
    (the store's server is the trainer's rank 0, which leaves next)."""
    store = torch.distributed.HashStore()
    got = _together(
        lambda: publish_verdict(store, verdict, rollout_ranks=2),
        lambda: await_verdict(store, 0),
        lambda: await_verdict(store, 1),
    )
    assert got[1:] == [verdict, verdict]
    assert store.check(["verdict/read/0", "verdict/read/1"])


def test_the_trainer_waits_for_the_readers_only_when_the_run_ends_there():
    store = torch.distributed.HashStore()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(publish_verdict, store, Verdict("go"), 1).result(timeout=TIMEOUT_S)
        ending = pool.submit(publish_verdict, store, Verdict("finished"), 1)
        with pytest.raises(TimeoutError):
            ending.result(timeout=TIMEOUT_S)  # no rollout rank has read it yet
        assert await_verdict(store, 0) == Verdict("finished")
        ending.result(timeout=4 * TIMEOUT_S)
