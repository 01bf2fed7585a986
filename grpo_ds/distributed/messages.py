"""The messages between the trainer and the rollout ranks of a split placement, and their one codec.

Every object that crosses the bridge (grpo_ds.distributed.bridge) is one of the frozen dataclasses
below; the weights' tensors travel beside them, as raw buffers. Who sends what:

    rollout ranks -> trainer:  Layout (once, at the start), then one Batch per step
    trainer -> rollout ranks:  Start (once), then GoAhead per step (each with new weights or not:
                               WeightBucket... WeightsEnd), and Stop (the end, or a preemption)
    other rollout ranks -> the first (continuous generation on several rollout ranks): one Share
                               per step, and a last Share of no step after the Stop

Wire format of one message (``encode``; ``decode`` reverses it):

    MAGIC (14 bytes) | version (uint16, big-endian) | kind length (uint8) | kind (ASCII, the class
    name) | body: pickle of the tuple of the fields' values, in declaration order

The envelope is checked before the body is used: a payload without MAGIC, of another
BRIDGE_VERSION, of a kind this side does not know, whose body does not unpickle into the kind's
fields with their declared types, or of a kind the receiver did not expect, is refused with one
line that names the side that sent it (``BridgeError``). Pickle carries the bodies: the two sides
are ranks of one job, running the same grpo_ds (the version says when they do not).
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

BRIDGE_VERSION = 3  # raise it when a message's fields or the wire format change
MAGIC = b"grpo_ds bridge"
_HEADER = struct.Struct(">HB")  # the version, the length of the kind's name


class BridgeError(RuntimeError):
    """A message the bridge refused, or a transfer that failed. Its text is one line that names the
    side at fault."""


# ---------------------------------------------------------------------------------- the messages


@dataclass(frozen=True)
class Layout:
    """The first rollout rank -> the trainer, at the start: what the rollout engine needs of a
    weight sync."""

    WHAT: ClassVar[str] = "layout of the rollout engine"
    START_UP: ClassVar[bool] = True  # waited for as long as a model takes to load

    # the fused layers a LoRA sync must complete (grpo_ds.rollout.base.RolloutEngine.whole_layers)
    whole_layers: dict | None


@dataclass(frozen=True)
class Start:
    """The trainer -> every rollout rank, once: the first step they generate, and the prompt
    sampler's state to draw it with."""

    WHAT: ClassVar[str] = "start"
    START_UP: ClassVar[bool] = True

    first_step: int
    sampler: dict | None  # the PromptSampler's state_dict; None: a fresh sampler
    data_changed: bool  # the data set changed since the checkpoint the sampler state comes from


@dataclass(frozen=True)
class GoAhead:
    """The trainer -> every rollout rank: generate step ``step``; when ``version`` is set, the
    weights after optimizer step ``version`` follow (WeightBucket... WeightsEnd)."""

    WHAT: ClassVar[str] = "go-ahead"
    START_UP: ClassVar[bool] = False

    step: int
    version: int | None  # None: keep the weights last sent


@dataclass(frozen=True)
class Batch:
    """The first rollout rank -> the trainer: one step's samples, and what the trainer logs and
    checkpoints beside them."""

    WHAT: ClassVar[str] = "batch of samples"
    START_UP: ClassVar[bool] = False

    step: int
    version: int  # sampled with the weights after optimizer step ``version`` (0: the initial ones)
    samples: Any  # the step's grpo_ds.step.batch.StepBatch (opaque: distributed imports no step)
    sampler: dict  # the prompt sampler's state after this step's draws
    stop: str | None = None  # a stop signal a rollout rank received (grpo_ds.run.preemption)
    busy_s: float = 0.0  # the rollout ranks' seconds collecting this step
    idle_s: float = 0.0  # their seconds waiting for the go-ahead (and its weights) before it
    # the first rollout rank's [phase, start, end] (time.time())
    spans: list = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Share:
    """A rollout rank after the first -> the first rollout rank, under continuous generation: its
    groups of step ``step``, all ended (the first rollout rank puts the step's batch together);
    ``step`` None: it sends no more."""

    WHAT: ClassVar[str] = "share of a batch"
    START_UP: ClassVar[bool] = False

    step: int | None
    rank: int  # the sender's place among the rollout ranks (its groups follow those before it)
    rollouts: Any = None  # grpo_ds.rollout.base.Rollouts of its groups, in order (opaque)
    decode_steps: int = 0  # its decode steps since its previous share
    rows: int = 0  # the rows it decoded over them (tokens picked)
    decode_s: float = 0.0  # its seconds of decoding over them


@dataclass(frozen=True)
class Preemption:
    """The trainer's grpo_ds.run.preemption.Preempted, field by field: every rollout rank raises the
    same, and leaves with its exit code."""

    signal_name: str
    step: int  # the last step trained
    total_steps: int
    checkpoint: str | None  # the checkpoint to resume from; None: none was written


@dataclass(frozen=True)
class Stop:
    """The trainer -> every rollout rank: leave. At the end of the run with its metrics history; on
    a preemption with ``preempted``."""

    WHAT: ClassVar[str] = "stop"
    START_UP: ClassVar[bool] = False

    history: list  # the run's metrics, one dict per step ([] on a preemption)
    preempted: Preemption | None = None


@dataclass(frozen=True)
class WeightBucket:
    """The trainer -> every rollout rank: the next flat buffer of weights holds these tensors, in
    order."""

    WHAT: ClassVar[str] = "weights"
    START_UP: ClassVar[bool] = False

    tensors: list  # (name, shape, torch.dtype) of each tensor, in the buffer's order


@dataclass(frozen=True)
class WeightsEnd:
    """The trainer -> every rollout rank: the weights of this go-ahead are all sent."""

    WHAT: ClassVar[str] = "weights"
    START_UP: ClassVar[bool] = False


Message = Layout | Start | GoAhead | Batch | Share | Stop | WeightBucket | WeightsEnd
KINDS: dict[str, type] = {kind.__name__: kind for kind in typing.get_args(Message)}
_FIELDS = {kind: [f.name for f in dataclasses.fields(kind)] for kind in KINDS.values()}
_HINTS = {kind: typing.get_type_hints(kind) for kind in KINDS.values()}


# ------------------------------------------------------------------------------------- the codec


def encode(message: Message) -> bytes:
    """``message`` as the bytes that travel (the wire format in the module's docstring)."""
    kind = type(message)
    if kind not in _FIELDS:
        raise TypeError(f"{kind.__name__} is not a bridge message (one of {', '.join(KINDS)})")
    name = kind.__name__.encode("ascii")
    body = pickle.dumps(tuple(getattr(message, f) for f in _FIELDS[kind]))
    return MAGIC + _HEADER.pack(BRIDGE_VERSION, len(name)) + name + body


def decode(payload: bytes, sender: str, expected: tuple[type, ...] = ()) -> Message:
    """The message in ``payload``, which ``sender`` ("the trainer", "the rollout ranks") sent; one
    of ``expected`` (any kind when empty). Raises BridgeError, one line naming ``sender``, for what
    it refuses."""
    head = len(MAGIC) + _HEADER.size
    if len(payload) < head or not payload.startswith(MAGIC):
        raise BridgeError(
            f"{sender} sent {len(payload)} bytes that are not a bridge message "
            f"(they do not start with {MAGIC!r})"
        )
    version, length = _HEADER.unpack_from(payload, len(MAGIC))
    if version != BRIDGE_VERSION:
        raise BridgeError(
            f"{sender} sent a message of version {version}; this side speaks "
            f"version {BRIDGE_VERSION} (grpo_ds.distributed.messages."
            "BRIDGE_VERSION): run the same grpo_ds on every rank"
        )
    name = payload[head : head + length].decode("ascii", errors="replace")
    kind = KINDS.get(name)
    if kind is None:
        raise BridgeError(
            f"{sender} sent a message of unknown kind {name!r} (this side knows {', '.join(KINDS)})"
        )
    if expected and kind not in expected:
        raise BridgeError(
            f"{sender} sent a {kind.WHAT} ({name}) where this side expected a "
            f"{what(expected)} ({' or '.join(k.__name__ for k in expected)})"
        )
    return kind(**_body(payload[head + length :], kind, sender))


def _body(body: bytes, kind: type, sender: str) -> dict[str, Any]:
    """The fields of a ``kind`` message from its pickled body, each of its declared type."""
    try:
        values = pickle.loads(body)
    except Exception as err:  # whatever unpickling raises: the bytes are the sender's
        raise BridgeError(
            f"{sender} sent a {kind.__name__} message whose body does not decode "
            f"({type(err).__name__}: {_first_line(err)})"
        ) from None
    names = _FIELDS[kind]
    if not isinstance(values, tuple) or len(values) != len(names):
        raise BridgeError(
            f"{sender} sent a {kind.__name__} message whose body is not its "
            f"{len(names)} fields ({', '.join(names) or 'none'})"
        )
    for name, value in zip(names, values, strict=True):
        if not _fits(value, _HINTS[kind][name]):
            hint = _HINTS[kind][name]
            raise BridgeError(
                f"{sender} sent a {kind.__name__} message whose {name} is a "
                f"{type(value).__name__}, not {getattr(hint, '__name__', hint)}"
            )
    return dict(zip(names, values, strict=True))


def _fits(value: Any, hint: Any) -> bool:
    """``value`` is of the declared type ``hint`` (the outer type: ``list[dict]`` checks a list)."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is float:  # an int is a float where a float is declared (sum([]) is 0)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


def what(kinds: tuple[type, ...]) -> str:
    """The words for a wait on one of ``kinds``: "go-ahead or stop"."""
    return " or ".join(dict.fromkeys(k.WHAT for k in kinds))


def _first_line(err: BaseException) -> str:
    lines = str(err).splitlines()
    return lines[0] if lines else "no message"
