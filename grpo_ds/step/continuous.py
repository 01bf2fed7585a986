"""The rollout rank of a split placement under continuous generation (rollout.continuous): the
engine never drains between steps.

Batch by batch (grpo_ds.step.schedule.serve_rollouts) the rollout rank generates step j's batch
until its longest completion ends, sends it, and only then starts step j+1: with long-tailed
completion lengths it spends much of a step decoding a few stragglers, and new weights enter only
between batches. Here one running batch (grpo_ds.rollout.hf_continuous) holds the groups of every
step the trainer has let it start:

- **Admission.** The go-ahead for step j (grpo_ds.step.schedule: it comes once the weights of step
  j-1-S exist, S = rollout.max_staleness) opens step j: its prompts are drawn, as batch by batch,
  and its groups queue in order; a group joins the running batch as soon as its G rows are free.
  So every token of a sample trained at step k is sampled with version k-1-S or newer: the bound of
  batch-by-batch holds per token, by admission (nothing in flight is ever thrown away).
- **Weights in flight.** A go-ahead that brings new weights is taken between two decode steps
  (grpo_ds.distributed.mailbox receives it while the engine decodes); the rows in flight go on with
  the new weights, each token recording its version.
- **Batches by step.** A step's batch goes up when its last group ends, its groups in their order
  in the step, whatever ended first: step k trains exactly the prompts it would batch by batch, in
  the same order (no bias towards short completions, nothing dropped). Its samples are scored here
  (the reward functions; the trainer adds the models'), as batch by batch.

- **Several rollout ranks.** Each decodes its own slice of every step's groups (the slice batch by
  batch would give it: a sample's stream is keyed by its place in the step, so it is the same
  sample on any rank) in a running batch of its own; every rank draws the step's prompts from the
  same sampler state. The others send their groups of a step to the first as a Share when their
  last group of it ends (grpo_ds.distributed.mailbox), and the first sends the step's batch up
  once its own groups and every share have come.

At S = 0 the go-ahead of step j needs the weights after step j-1, which need step j-1's batch: the
sides take turns as batch by batch, and the samples are the same (a sample's tokens are drawn from
its own stream, grpo_ds.rollout.streams), the running batch refilling within a step only.

What a batch reports: its steps' token versions (the trainer's staleness metrics per token:
grpo_ds.step.schedule.SplitTrainer), and over the time since the previous batch the engine's mean
running batch (``rollout/running_rows_mean``), its tokens per second of decoding
(``rollout/tokens_per_s``), and the phases: rollout (decoding), sync (weights), reward, wait
(nothing to decode). The rank log's record of a batch holds its phase spans and the running batch
over time (``running_rows``: [time, rows] every 0.02 s of decoding, at most 64 a batch), which the
timeline draws.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpo_ds.distributed.bridge import Bridge
from grpo_ds.distributed.mailbox import Inbox, Outbox
from grpo_ds.distributed.messages import Batch, GoAhead, Share, Stop
from grpo_ds.rollout.base import Rollouts
from grpo_ds.rollout.hf_continuous import GroupRequest
from grpo_ds.run.preemption import Preempted, StopRequest
from grpo_ds.run.prompts import PromptSampler
from grpo_ds.run.writes import append_line
from grpo_ds.step.collect import scored_batch, step_sampling
from grpo_ds.step.context import StepContext


@dataclass
class _OpenStep:
    """A step the go-ahead opened: its prompts, the sampler after drawing them, its groups done."""

    prompt_index: list[int]
    sampler: dict
    groups: dict[int, Rollouts] = field(default_factory=dict)  # this rank's, by place in the step
    shares: list[Share] = field(default_factory=list)  # the other rollout ranks' (the first's)

    def done(self, mine: int, peers: int) -> bool:
        """Whether this rank's ``mine`` groups have ended and ``peers`` shares have come."""
        return len(self.groups) == mine and len(self.shares) == peers


class _Phases:
    """The rollout rank's phases since the last batch: seconds per phase and [phase, start, end]
    spans (time.time()), one span per stretch of the same phase."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.spans: list[list] = []
        self._phase, self._since = None, time.time()

    def enter(self, phase: str) -> None:
        if phase == self._phase:
            return
        self._close(time.time())
        self._phase = phase

    def _close(self, now: float) -> None:
        if self._phase is not None and now > self._since:
            self.times[self._phase] = self.times.get(self._phase, 0.0) + now - self._since
            self.spans.append([self._phase, round(self._since, 4), round(now, 4)])
        self._since = now

    def take(self) -> tuple[dict[str, float], list[list]]:
        """The phases since the last take; the time until the next ``enter`` is the caller's to
        count."""
        self._close(time.time())
        out = (self.times, self.spans)
        self.times, self.spans, self._phase = {}, [], None
        return out


class _Running:
    """The running batch over time: [time.time(), rows in flight] at most every EVERY_S seconds of
    decoding, at most MOST of them a batch (evenly thinned), for the timeline (grpo_ds.plot
    --timeline)."""

    EVERY_S, MOST = 0.02, 64

    def __init__(self) -> None:
        self._samples: list[list] = []
        self._last = 0.0

    def sample(self, rows: int) -> None:
        now = time.time()
        if now - self._last >= self.EVERY_S:
            self._samples.append([round(now, 3), rows])
            self._last = now

    def take(self) -> list[list]:
        out, self._samples = self._samples, []
        if len(out) > self.MOST:
            out = [out[round(i * (len(out) - 1) / (self.MOST - 1))] for i in range(self.MOST)]
        return out


def serve_continuous(
    ctx: StepContext, bridge: Bridge, stop: StopRequest, rank_log: Path, sampler: PromptSampler
) -> list[dict]:
    """The rollout rank's side of split placement under continuous generation, from the first
    go-ahead to the trainer's Stop (the Start has set ``sampler`` up); returns the run's metrics
    history the trainer sends at the end. With several rollout ranks each decodes its own slice of
    every step's groups, and the first puts each step's batch together from its own and the
    others' shares."""
    recipe, dist = ctx.recipe, ctx.dist
    P, G = recipe.rollout.prompts_per_step, ctx.group_size
    lo, hi = dist.dp_slice(P)  # this rank's groups of every step
    decoder = ctx.rollout.continuous(recipe.rollout.generation_batch_prompts * G)
    peers = tuple(range(Bridge.ROLLOUT_LEAD + 1, 1 + dist.dp_size)) if dist.is_main else ()
    inbox = Inbox(bridge, peers)
    outbox = Outbox(bridge.send if dist.is_main else bridge.send_share)
    opened: dict[int, _OpenStep] = {}
    early: dict[int, list[Share]] = {}  # shares whose go-ahead this rank has not polled yet
    queued: deque[GroupRequest] = deque()
    phases, running = _Phases(), _Running()
    while True:
        while opened and opened[first := min(opened)].done(hi - lo, len(peers)):
            done, clocks = opened.pop(first), (phases, running)
            if dist.is_main:
                _send(first, done, ctx, decoder, clocks, outbox, stop, rank_log)
            else:
                _send_share(first, dist.dp_rank, done, decoder, clocks, outbox, rank_log)
        outbox.check()
        idle = not decoder.rows_in_flight and not queued
        if idle:
            phases.enter("wait")
        match message := inbox.poll(block=idle):
            case Stop():
                _leave(inbox, outbox, dist.dp_rank, bridge.timeout_s)
                if message.preempted is None:
                    return message.history
                p = message.preempted  # every rank leaves with the trainer's exit code
                raise Preempted(p.signal_name, p.step, p.total_steps, p.checkpoint)
            case GoAhead():
                if message.version is not None:
                    phases.enter("sync")
                    decoder.load_weights(inbox.weights(), message.version)
                opened[message.step], requests = _opened(message.step, ctx, sampler, (lo, hi))
                opened[message.step].shares += early.pop(message.step, [])
                queued.extend(requests)
                continue
            case Share():  # it may overtake its go-ahead (each comes in a thread of its own)
                step = opened.get(message.step)
                (step.shares if step else early.setdefault(message.step, [])).append(message)
                continue
        while queued and decoder.free_rows >= G:
            decoder.admit(queued.popleft())
        phases.enter("rollout")
        running.sample(decoder.rows_in_flight)
        for group in decoder.step():
            opened[group.step].groups[group.group] = group.rollouts


def _opened(
    step: int, ctx: StepContext, sampler: PromptSampler, mine: tuple[int, int]
) -> tuple[_OpenStep, list[GroupRequest]]:
    """Step ``step`` opened by its go-ahead: its prompts, drawn as batch by batch (every rollout
    rank draws the same), and the requests of this rank's groups ``mine`` = [lo, hi)."""
    P, G = ctx.recipe.rollout.prompts_per_step, ctx.group_size
    indices = sampler.next_indices(P)
    sampling = step_sampling(ctx.recipe, step)
    requests = [
        GroupRequest(
            step, g, ctx.inputs.prompts[indices[g]].prompt_ids, G, replace(sampling, first_prompt=g)
        )
        for g in range(*mine)
    ]
    return _OpenStep(indices, sampler.state_dict()), requests


def _leave(inbox: Inbox, outbox: Outbox, rank: int, timeout_s: float) -> None:
    """At the Stop: the other rollout ranks send their last share, the first waits for them."""
    if rank:
        outbox.put(Share(None, rank))
    outbox.close()
    inbox.close(timeout_s)


def _send_share(
    step: int,
    rank: int,
    done: _OpenStep,
    decoder,
    clocks: tuple[_Phases, _Running],
    outbox: Outbox,
    rank_log: Path,
) -> None:
    """A rollout rank after the first: its groups of step ``step``, in order, to the first; its
    rank log's record of them."""
    phases, running = clocks
    rollouts = Rollouts.concat(done.groups[g] for g in sorted(done.groups))
    times, spans = phases.take()
    decode_steps, rows = decoder.take_stats()
    outbox.put(Share(step, rank, rollouts, decode_steps, rows, times.get("rollout", 0.0)))
    oldest = min(v for versions in rollouts.token_versions for v in versions)
    record = {
        "step": step,
        "role": "rollout",
        "weight_version": oldest,
        "phases": spans,
        "running_rows": running.take(),
    }
    append_line(rank_log, json.dumps(record))


def _send(
    step: int,
    done: _OpenStep,
    ctx: StepContext,
    decoder,
    clocks: tuple[_Phases, _Running],
    outbox: Outbox,
    stop: StopRequest,
    rank_log: Path,
) -> None:
    """Step ``step``'s batch, its groups in order, scored and queued to go up; the rank log's
    record of it carries the phases and the running batch since the last one."""
    phases, running = clocks
    shares = sorted(done.shares, key=lambda share: share.rank)
    rollouts = Rollouts.concat(
        [*(done.groups[g] for g in sorted(done.groups)), *(share.rollouts for share in shares)]
    )
    times, spans = phases.take()  # the scoring's own phases join them
    # every batch reports each phase, at 0 where it had none since the batch before (a step whose
    # groups all ended while the step before it finished)
    times = {"wait": 0.0, "sync": 0.0, "rollout": 0.0, **times}
    decoding = times["rollout"]
    data = scored_batch(ctx, done.prompt_index, rollouts, times, spans)
    decode_steps, rows = decoder.take_stats()
    # over the rollout ranks: the mean running batch of a rank, and their tokens a second together
    steps_all = decode_steps + sum(share.decode_steps for share in shares)
    data.metrics["rollout/running_rows_mean"] = (
        (rows + sum(share.rows for share in shares)) / steps_all if steps_all else 0.0
    )
    data.metrics["rollout/tokens_per_s"] = sum(
        n / seconds
        for n, seconds in [(rows, decoding), *((s.rows, s.decode_s) for s in shares)]
        if seconds
    )
    oldest = min(v for versions in rollouts.token_versions for v in versions)
    busy = sum(s for phase, s in data.times.items() if phase != "wait")
    outbox.put(
        Batch(
            step,
            oldest,
            data,
            done.sampler,
            stop.signal_name,
            busy,
            data.times.get("wait", 0.0),
            data.spans,
        )
    )
    record = {
        "step": step,
        "role": "rollout",
        "weight_version": oldest,
        "phases": data.spans,
        "running_rows": running.take(),
    }
    append_line(rank_log, json.dumps(record))
