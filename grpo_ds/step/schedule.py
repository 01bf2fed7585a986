"""The order of a step's phases across ranks: who generates, who trains, and when weights travel.

The driver loop (grpo_ds.train) asks its schedule for each step's samples (``batch``) and tells it
when the weights changed (``weights_changed``); what happens in between depends on the placement
(grpo_ds.config.placement):

- ``Colocated``: every rank generates its slice of the step (grpo_ds.step.collect), trains, and
  writes the new weights into its own rollout engine. Generation and training take turns on the same
  ranks.
- ``SplitTrainer`` (the trainer's ranks of a split placement) and ``serve_rollouts`` (the rollout
  ranks' side of the same schedule): the rollout ranks collect step j's samples with the weights of
  step ``j-1-S`` or newer (S = rollout.max_staleness) while the trainer trains earlier steps. They
  talk over the bridge (grpo_ds.distributed.bridge) in the typed messages of
  grpo_ds.distributed.messages, each side through one receive: the trainer's rank 0 in
  ``SplitTrainer._receive``, the rollout ranks in ``serve_rollouts``'s loop. At the start the first
  rollout rank sends its engine's ``Layout`` and the trainer answers with ``Start`` (the first step
  to generate, the prompt sampler's state); then both sides run the same sequence of transfers:

      rollout ranks:  GoAhead j (+ weights when newer ones are due) -> collect j -> Batch j
                      -> GoAhead j+1 ...
      trainer:        ... train k -> receive Batches up to k+S -> GoAhead k+1+S with weights v_k
                      -> train k+1 ...

  and a ``Stop`` ends it: with the metrics history at the end, with the trainer's ``Preemption``
  on a stop signal. The trainer's rank 0 gives each Batch's samples to the other trainer ranks.

  The go-ahead for step j needs the weights of step j-1-S, so the rollout side is never more than S
  steps ahead, and it waits (nothing is dropped): every prompt is trained once and in the order of
  S = 0, whatever the timing. At S = 0 the sides take turns and train exactly the samples of a
  colocated run on the same trainer ranks (a sample is drawn with the step's seed and its place in
  the batch, whatever generates it). A Batch carries the weight version it was sampled with
  (staleness = k-1-version at step k), the prompt sampler's state after its draws, and the rollout
  ranks' phase spans and busy / idle seconds. The batches received ahead are the checkpoint's
  in-flight work (``in_flight``): a resume trains them, then goes on from the sampler state the
  last one carries, so a run killed and resumed matches the run that was not.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from grpo_ds.distributed.bridge import Bridge
from grpo_ds.distributed.messages import Batch, GoAhead, Layout, Preemption, Start, Stop
from grpo_ds.rollout.base import Rollouts, SamplerSettings
from grpo_ds.run.folder import trim_log
from grpo_ds.run.preemption import Preempted, StopRequest
from grpo_ds.run.prompts import PromptSampler
from grpo_ds.run.writes import append_line
from grpo_ds.step.batch import StepBatch
from grpo_ds.step.collect import collect, score_models_on_trainer
from grpo_ds.step.context import StepContext
from grpo_ds.step.continuous import serve_continuous
from grpo_ds.step.profiling import Phase


def weights_needed(step: int, staleness: int, resumed_after: int) -> int:
    """The oldest weight version step ``step``'s samples may be generated with (the trainer holds
    ``resumed_after``'s at the start)."""
    return max(resumed_after, step - 1 - staleness)


# ---------------------------------------------------------------------------------------- colocated


class Colocated:
    """Every rank generates, then trains: ``batch`` collects the step on the training ranks
    themselves."""

    role = "colocated"
    rollout_stop = None  # every rank's own stop request is agreed on by the driver

    def __init__(self, ctx: StepContext, sampler: PromptSampler) -> None:
        self.ctx, self.sampler = ctx, sampler

    def start(
        self, resumed_after: int, policy, trainer_state: dict | None, data_changed: bool = False
    ) -> None:
        if trainer_state is not None:  # a resume: the rollout engine gets the restored weights
            sync_weights(policy, self.ctx.rollout, self.ctx.bucket_bytes)

    def batch(self, step: int) -> StepBatch:
        return collect(step, self.ctx, self.sampler)

    def weights_changed(self, step: int, policy, times: dict, spans: list) -> None:
        with Phase("sync", times, spans):
            sync_weights(policy, self.ctx.rollout, self.ctx.bucket_bytes)

    def in_flight(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def stop(self, stopped: Preempted) -> None:
        pass

    def finish(self, history: list[dict]) -> None:
        pass


def sync_weights(policy, rollout, bucket_bytes: int) -> None:
    """The policy's weights into the rank's rollout engine (nothing to send when it generates with
    the policy's module). Collective over the trainer's ranks (ZeRO-3 gathers)."""
    if not rollout.shares_policy_weights:
        rollout.update_weights(policy.rollout_weights(bucket_bytes, rollout.whole_layers))


# ------------------------------------------------------------------------------- split: the trainer


class SplitTrainer:
    """The trainer's side of split placement; every trainer rank holds one, rank 0 the bridge."""

    role = "trainer"

    def __init__(self, ctx: StepContext, bridge: Bridge | None) -> None:
        recipe = ctx.recipe
        self.ctx, self.dist, self.bridge, self.bucket_bytes = (
            ctx,
            ctx.dist,
            bridge,
            ctx.bucket_bytes,
        )
        self.staleness, self.steps = ctx.inputs.placement.max_staleness, recipe.train.steps
        self.received: dict[int, Batch] = {}  # rank 0: batches received ahead of training
        # the vLLM engine's fused layers (a LoRA sync completes them: Policy.rollout_weights)
        self.whole_layers = None
        self.sampler_state: dict | None = None  # the sampler after the last step trained (rank 0)
        r = recipe.rollout
        # what its log-probs replay
        self.sampler_settings = SamplerSettings(r.temperature, r.top_k, r.top_p)
        # a stop signal a rollout rank received, as the last batch said
        self.rollout_stop: str | None = None
        # the rollout engine never drains (grpo_ds.step.continuous): a go-ahead does not wait for
        # the batch before it
        self.continuous = r.continuous

    # ---- the start: where the rollout ranks begin, and the weights they begin with
    def start(
        self, resumed_after: int, policy, trainer_state: dict | None, data_changed: bool = False
    ) -> None:
        """``trainer_state``: the checkpoint's (None: a fresh run). Tells the rollout ranks the
        first step they generate and the sampler state to draw it with (the in-flight batches come
        back from the checkpoint, unless it was written under another max_staleness or the data
        changed: then they are drawn again), and sends the first go-ahead(s) with the weights."""
        self.resumed_after = resumed_after
        state, plan = trainer_state or {}, None
        if self.dist.is_main:
            layout = self._receive(Layout)  # waits as long as the rollout engine takes to load
            flight = state.get("in_flight") or {}
            kept = (
                []
                if data_changed or flight.get("staleness") != self.staleness
                else [_from_record(record) for record in flight.get("batches", [])]
            )
            self.received = {b.step: b for b in kept}
            self.sampler_state = state.get("sampler")
            first = resumed_after + 1 + len(kept)
            sampler = kept[-1].sampler if kept else self.sampler_state
            self.bridge.broadcast(Start(first, sampler, data_changed))
            plan = (layout.whole_layers, first)
        self.whole_layers, first = self.dist.broadcast(plan)
        self.next_go, self.last_received, self.sent_version = first, first - 1, None
        self._go_ahead(resumed_after, policy, {}, [])

    def batch(self, step: int) -> StepBatch:
        """Step ``step``'s samples on every trainer rank (rank 0 waits for them if they have not
        come)."""
        produced, waited = None, time.perf_counter()
        if self.dist.is_main:
            while step not in self.received:
                self._receive()
            produced = self.received.pop(step)
            self.sampler_state = produced.sampler
        produced = self.dist.broadcast(produced)
        data = produced.samples
        # drawn by other processes, or before a resume: with what the trainer's log-probs replay, or
        # refused
        data.rollouts.check_drawn_with(self.sampler_settings, f"step {step}")
        # the trainer's step time is its own; the rollout ranks' phase times and spans ride along
        data.rollout_side = {
            "times": data.times,
            "spans": produced.spans,
            "busy_s": produced.busy_s,
            "idle_s": produced.idle_s,
        }
        idle = time.perf_counter() - waited  # this rank waited for the rollout ranks
        data.times, data.spans = (
            {"wait": idle},
            [["wait", round(time.time() - idle, 4), round(time.time(), 4)]],
        )
        data.weight_version = produced.version
        data.metrics.update(
            {
                **staleness_metrics(step, produced.version, data.rollouts.token_versions),
                "placement/rollout_busy_s": produced.busy_s,
                "placement/rollout_idle_s": produced.idle_s,
            }
        )
        self.rollout_stop = produced.stop
        # scored here, on the trainer ranks, which hold the models
        if self.ctx.reward_models is not None:
            score_models_on_trainer(data, self.ctx)
        return data

    def weights_changed(self, step: int, policy, times: dict, spans: list) -> None:
        """After optimizer step ``step``: the go-ahead for every step whose weights now exist, with
        them; and every batch up to step+S received, even where no go-ahead follows (the run's last
        steps): those were sampled with weights older than step's, which a checkpoint of this step
        no longer holds, so it must hold the batches."""
        self._go_ahead(step, policy, times, spans)
        # under continuous generation a batch may wait for its last straggler while later steps'
        # groups decode: the next step waits for its own batch only (a checkpoint holds the batches
        # received so far, and a resume draws the others again)
        if self.continuous:
            return
        if self.dist.is_main and self.last_received < min(step + self.staleness, self.steps):
            with Phase("wait", times, spans):
                while self.last_received < min(step + self.staleness, self.steps):
                    self._receive()

    def _go_ahead(self, trained: int, policy, times: dict, spans: list) -> None:
        while (
            self.next_go <= self.steps
            and weights_needed(self.next_go, self.staleness, self.resumed_after) <= trained
        ):
            if self.dist.is_main and not self.continuous and self.last_received < self.next_go - 1:
                # the rollout ranks send step next_go-1 before they wait for this go-ahead (a
                # continuous engine takes it while it decodes)
                with Phase("wait", times, spans):
                    while self.last_received < self.next_go - 1:
                        self._receive()
            version = weights_needed(self.next_go, self.staleness, self.resumed_after)
            send = version != self.sent_version  # the same answer on every trainer rank
            if self.dist.is_main:
                self.bridge.broadcast(GoAhead(self.next_go, version if send else None))
            if send:
                with Phase("sync", times, spans):
                    weights = policy.rollout_weights(self.bucket_bytes, self.whole_layers)
                    if self.dist.is_main:
                        self.bridge.send_weights(weights, self.bucket_bytes)
                    else:
                        # the gather is collective: every trainer rank consumes it
                        for _ in weights:
                            pass
                self.sent_version = version
            self.next_go += 1

    def _receive(self, kind: type[Layout] | type[Batch] = Batch) -> Layout | Batch:
        """Rank 0's one receive from the rollout ranks: their Layout at the start, then a Batch per
        step, kept until its step trains."""
        message = self.bridge.receive(kind)
        if isinstance(message, Batch):
            self.received[message.step] = message
            self.last_received = message.step
        return message

    def in_flight(self) -> dict:
        """The checkpoint's part: the sampler after the last trained step, and the batches received
        ahead."""
        if not self.dist.is_main:
            return {}
        return {
            "sampler": self.sampler_state,
            "in_flight": {
                "staleness": self.staleness,
                "batches": [_record(self.received[s]) for s in sorted(self.received)],
            },
        }

    def stop(self, stopped: Preempted) -> None:
        """The run stops early (preemption, ``stopped``): the batches the rollout ranks are making
        (one; under continuous generation every step with a go-ahead) are taken and dropped (a
        resume draws them again), then they stop with the same exception."""
        if self.dist.is_main:
            # a continuous engine may be making every step it has had a go-ahead for
            while self.last_received < self.next_go - 1:
                self._receive()
            self.bridge.broadcast(
                Stop(
                    [],
                    Preemption(
                        stopped.signal_name, stopped.step, stopped.total_steps, stopped.checkpoint
                    ),
                )
            )

    def finish(self, history: list[dict]) -> None:
        """The end of the run: the rollout ranks, done with the last step, get the history and
        leave."""
        if self.dist.is_main:
            self.bridge.broadcast(Stop(history))


def staleness_metrics(step: int, oldest: int, token_versions: list[list[int]] | None) -> dict:
    """How old the weights were that step ``step``'s samples were drawn with (staleness k-1-v for a
    token of version v): per token where the engine records versions per token (continuous
    generation), with the spread of versions within a sample and the fraction of samples that span
    a weight update; else every token ``oldest``'s."""
    if token_versions is None:
        return {
            "placement/staleness_mean": float(step - 1 - oldest),
            "placement/staleness_max": step - 1 - oldest,
        }
    versions = [v for sample in token_versions for v in sample]
    spreads = [max(sample) - min(sample) for sample in token_versions]
    return {
        "placement/staleness_mean": step - 1 - sum(versions) / len(versions),
        "placement/staleness_max": step - 1 - min(versions),
        "placement/version_spread_max": max(spreads),
        "placement/samples_spanning_update_frac": sum(s > 0 for s in spreads) / len(spreads),
    }


def _record(b: Batch) -> dict:
    """A batch received ahead, as the checkpoint holds it (trainer_state.json's in_flight), its
    samples under "batch"."""
    record = {
        ("batch" if k == "samples" else k): v
        for k, v in dataclasses.asdict(dataclasses.replace(b, samples=None)).items()
    }
    s = b.samples
    record["batch"] = {
        "prompt_index": s.prompt_index,
        "rollouts": dataclasses.asdict(s.rollouts),
        "rewards": s.rewards,
        "metrics": s.metrics,
        "times": s.times,
        "spans": s.spans,
    }
    return record


def _from_record(record: dict) -> Batch:
    b = record["batch"]
    samples = StepBatch(
        b["prompt_index"],
        Rollouts.from_record(b["rollouts"]),
        b["rewards"],
        b["metrics"],
        b["times"],
        spans=b["spans"],
    )
    fields = {k: v for k, v in record.items() if k != "batch"}
    # the stop it carried was this attempt's, not the next
    return Batch(**{**fields, "samples": samples, "stop": None})


# ------------------------------------------------------------------------- split: the rollout ranks


def serve_rollouts(
    ctx: StepContext, bridge: Bridge, stop: StopRequest, rank_log: Path
) -> list[dict]:
    """The rollout ranks' side of split placement, from the start to the end of the run: wait for
    the go-ahead of a step (and the weights it brings), collect the step's samples over the
    rollout ranks (grpo_ds.step.collect), and the first of them sends them to the trainer. Returns
    the run's metrics history the trainer sends at the end."""
    engine, lead = ctx.rollout, ctx.dist.is_main
    if lead:  # the trainer may still be loading its model, or a checkpoint: a start-up wait
        bridge.send(Layout(engine.whole_layers))
    sampler = _start_drawing(bridge.receive(Start), ctx, rank_log)
    if ctx.recipe.rollout.continuous:  # the engine never drains (grpo_ds.step.continuous)
        return serve_continuous(ctx, bridge, stop, rank_log, sampler)
    version, sent_idle = None, 0.0
    while True:  # the rollout ranks' one receive loop: go-aheads until the stop
        waited, wall = time.perf_counter(), time.time()
        match message := bridge.receive(GoAhead, Stop):
            case Stop(preempted=None):
                return message.history
            case Stop(preempted=p):  # every rank leaves with the trainer's exit code
                raise Preempted(p.signal_name, p.step, p.total_steps, p.checkpoint)
            case GoAhead() if message.version is not None:  # new weights come with it
                engine.update_weights(bridge.receive_weights())
                version = message.version
        step, idle = message.step, time.perf_counter() - waited
        data = collect(step, ctx, sampler)
        phases = [["wait", wall, wall + idle]] + data.spans
        if lead:
            batch = Batch(
                step,
                version,
                data,
                sampler.state_dict(),
                stop.signal_name,
                sum(data.times.values()),
                idle + sent_idle,
                phases,
            )
            # the send waits while the trainer is busy: idle time, counted with the next step
            with Phase("send") as sending:
                bridge.send(batch)
            sent_idle = sending.seconds
            phases.append(["send", time.time() - sending.seconds, time.time()])
        append_line(
            rank_log,
            json.dumps(
                {"step": step, "role": "rollout", "weight_version": version, "phases": phases}
            ),
        )


def _start_drawing(start: Start, ctx: StepContext, rank_log: Path) -> PromptSampler:
    """The prompt sampler the Start message sets up; what a stopped attempt logged past the
    checkpoint goes from this rank's log (it is drawn again)."""
    rank_log.parent.mkdir(parents=True, exist_ok=True)  # the trainer has made the run folder
    trim_log(rank_log, start.first_step - 1)
    sampler = PromptSampler(len(ctx.inputs.prompts), ctx.recipe.run.seed, ctx.recipe.data.shuffle)
    if start.sampler is not None:
        sampler.load_state_dict(start.sampler, data_changed=start.data_changed)
    return sampler
