"""A model of the steady-state step time of colocated and split placement (issue 35), from measured
phase costs.

    python benchmarks/simulate_placement.py --inputs IN.json [--world W] [--rollout-ranks K ...]
        [--staleness S]
    python benchmarks/simulate_placement.py --inputs IN.json --measured RUNS.json   # exit 1 if a
        row is off > 15%
    python benchmarks/simulate_placement.py --published   # NeMo-RL's Llama-3.1-8B on 16 x H100,
                                                            beside the model
    python benchmarks/simulate_placement.py --long-tail   # continuous generation at GPU scale

Pure Python, no torch; ``predict(inputs, placement, world, rollout_ranks, staleness) ->
Prediction``.
Phases of one step of N = samples_per_step samples, on n ranks:
  gen(n)   = generate_overhead_s + token_steps * t_token(b_active) on each generating rank: b =
             ceil(N / n) samples decode at once, and b_active = b * mean_new_tokens / token_steps is
             the batch a decode step sees on average (finished samples leave a continuously batched
             engine; b when every sample runs to the limit). t_token is piecewise-linear over the
             measured (batch, seconds per token step) points: flat below the first point (a GPU),
             the last segment extended above the last (a CPU is ~linear).
  train(n) = N * (train_s_per_sample + logprob_s_per_sample) / (n * e), e = train_efficiency if n >
             1 else 1.
  reward_s, sync_s: per step (sync_s colocated: into the rank's own engine; split_sync_s: trainer ->
      rollout).
Colocated (every rank generates its share, then all train, in turn): step = gen(W) + reward +
train(W) + sync. Split, K rollout ranks and W-K trainer ranks; G = gen(K), T = train(W-K), the
reward added to the side that scores (``reward_side``, "rollout": the rollout ranks score before
sending), X = split_sync_s:
  S = 0: batch k is generated with v_{k-1}, which exists only after train k-1: the sides take turns,
         step = G + T + X.
  S >= 1: trainer: train k -> receive batch k+S -> broadcast v_k; rollout: generate k+S (with
         v_{k-1}) -> send batch k+S -> receive v_k. The broadcast of v_k is a collective both sides
         are in: it starts when the later side is ready (trainer: train k done and batch k+S
         received; rollout: batch k+S sent), both leave it together and start step k+1 at the same
         instant, so step = max(G, T) + X.
         All of X is unhidden: hiding it would need the rollout ranks to receive v_k while still
         generating with v_{k-1} (a second weight buffer), which this schedule has not. Every S >= 1
         gives the same steady state; a deeper pipeline only absorbs step-to-step jitter, which a
         steady-state model does not see.
  S >= 1 with continuous generation (rollout.continuous, issue 52): simulated step by step, not
         a formula (simulate_continuous), as the pipeline's fill and drain depend on the lengths
         drawn. Each rollout rank keeps one running batch of up to capacity_rows rows (default:
         every row of the S+1 steps it may hold, (S+1) x ceil(N / K)); a decode step costs
         t_token(rows running) and every running row gains a token; a row leaves at its length,
         drawn (seeded) from ``lengths``; a step's share on a rank is done when its last row
         leaves, then scored (reward). The trainer trains step k (T) once every rank's share has
         come, then sends v_k (X); the rank takes it between two decode steps, loading it in
         weight_load_s (hf: the copy and the KV recompute), with the go-ahead of step k+S+1, whose
         rows join as rows free up. The step is the trainer's mean over steps 21..200; the
         trainer's idle is its wait for a batch, the rollout's its wait for a go-ahead with nothing
         running.
         Batch by batch, a generate call runs L decode steps (the longest of its b samples, from
         ``lengths`` or longest_new_tokens, else token_steps) at b x m / L sequences on average.
Idle fraction = time a side waits for the other / step (the transfer counts as busy on both sides):
split S = 0 trainer G/step, rollout T/step; S >= 1 trainer (max - T)/step, rollout (max - G)/step;
colocated, the ranks are the trainer idle while they generate and score ((gen + reward)/step) and
the rollout engine idle while they train.

--inputs FILE (JSON object): samples_per_step, token_steps (decode steps per generate call:
max_new_tokens), t_token ([[batch, s], ...]) and train_s_per_sample are required; mean_new_tokens
(token_steps), longest_new_tokens (token_steps: a generate call's decode steps), lengths (a list of
sample lengths, the empirical distribution: the mean and a call's expected longest sample come from
it), capacity_rows (the running batch of continuous generation; default every row of the steps in
flight), weight_load_s (0: a rollout rank's seconds to take new weights between two decode steps,
continuous), generate_overhead_s (0), logprob_s_per_sample (0, the old/ref log-prob passes),
train_efficiency (1.0), reward_s (0), reward_side ("rollout" | "trainer"), sync_s (0), split_sync_s
(sync_s), world (2), rollout_ranks (1) and staleness (1, the split row besides S = 0) are optional;
the command line's --world/--rollout-ranks/--staleness override the last three.

--measured FILE, as benchmarks/bench_placement.py writes it (``inputs``, optional, is used without
--inputs):
  {"machine": "...", "commit": "...", "inputs": {...},
   "runs": [{"placement": "colocated" | "split", "world": 2, "rollout_ranks": 0, "staleness": 0, "continuous": false,
             "step_s": 12.3,
             "samples_per_step": 8, "phases": {"rollout": 5.0, "reward": 0.1, "logprob": 1.0, "update": 5.5,
             "sync": 0.4}}, ...]}
step_s is the mean of the steady steps (leave out the first ones: warm-up and the pipeline's fill,
which the model does not see); a run's own "inputs" object, optional, overrides the file's for that
run (a measured decode cost of its own, say); phases are grpo_ds's phase names (StepBatch.times), for a look at
which phase the model misses. Each run is predicted at its own W, K, S (and samples_per_step when
given); the error per row is (predicted - measured) / measured step_s, and the command exits 1 when
any is beyond +-15%.

--long-tail: continuous against batch-by-batch generation at GPU scale, for stated shapes (8 GPUs,
split 4 + 4, S = 1, 2 and 4, 0.5B, 1.5B and 7B policies, a long-tailed length distribution): the model's
inputs are assumptions, listed with the table; beside it the figures the anchors published.

--published: NeMo-RL v0.5's GRPO on Llama-3.1-8B-Instruct, 16 x H100, BF16, Megatron-core: on policy
(colocated) 92.8 s a step, 1,581 tokens/s/GPU; one step off (8 generation + 8 training GPUs) 64.8 s,
2,478 tokens/s/GPU. Source: https://docs.nvidia.com/nemo/rl/0.5.0/about/performance-summary.html
(docs/about/performance-summary.md of github.com/NVIDIA-NeMo/RL at r0.5.0); layout and batch from
that repository's recipes
examples/configs/recipes/llm/performance/{grpo,async-grpo}-llama3.1-8b-instruct-2n8g.yaml. Each
input is marked measured (with its source) or assumed; no input is fitted to the published step
times.
"""  # noqa: E501

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED = ("samples_per_step", "token_steps", "t_token", "train_s_per_sample")
DEFAULTS = {
    "mean_new_tokens": None,
    "longest_new_tokens": None,
    "lengths": None,
    "capacity_rows": None,
    "weight_load_s": 0.0,
    "generate_overhead_s": 0.0,
    "logprob_s_per_sample": 0.0,
    "train_efficiency": 1.0,
    "reward_s": 0.0,
    "reward_side": "rollout",
    "sync_s": 0.0,
    "split_sync_s": None,
    "world": 2,
    "rollout_ranks": 1,
    "staleness": 1,
}
# --measured: the largest |predicted - measured| / measured step time accepted (issue 35)
TOLERANCE = 0.15


@dataclass(frozen=True)
class Prediction:
    placement: str
    world: int
    rollout_ranks: int  # K; 0 colocated
    staleness: int
    step_s: float
    samples_per_s: float
    trainer_idle: float  # fraction of the step the trainer waits for the rollout side
    rollout_idle: float  # fraction of the step the rollout side waits for the trainer
    # seconds per phase: rollout, reward, logprob, update, sync
    phases: dict = field(default_factory=dict)


def check_inputs(raw: dict) -> dict:
    """The inputs with defaults filled in; ValueError naming the key for a missing, unknown or bad
    one."""
    unknown = sorted(set(raw) - set(REQUIRED) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"inputs: unknown key {unknown[0]!r}; known: {', '.join([*REQUIRED, *DEFAULTS])}"
        )
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(
            f"inputs: {missing[0]!r} is required (see the docstring of {Path(__file__).name})"
        )
    out = {**DEFAULTS, **raw}
    lengths = out.pop("lengths")
    if lengths is not None:  # an empirical length distribution: its mean, its tail
        if (
            not isinstance(lengths, list)
            or not lengths
            or not all(isinstance(n, (int, float)) and 0 < n <= out["token_steps"] for n in lengths)
        ):
            raise ValueError("inputs: lengths must be a list of sample lengths in [1, token_steps]")
        out["mean_new_tokens"] = out["mean_new_tokens"] or sum(lengths) / len(lengths)
        out["lengths"] = sorted(lengths)
    else:
        out["lengths"] = None
    out["mean_new_tokens"] = out["mean_new_tokens"] or out["token_steps"]
    out["split_sync_s"] = out["sync_s"] if out["split_sync_s"] is None else out["split_sync_s"]
    for key, value in out.items():
        above_0 = key in (
            "samples_per_step",
            "token_steps",
            "mean_new_tokens",
            "train_efficiency",
            "world",
        )
        if value is None and key in ("longest_new_tokens", "capacity_rows"):
            continue
        if key not in ("t_token", "reward_side", "lengths") and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
            or (above_0 and value == 0)
        ):
            raise ValueError(
                f"inputs: {key} is {value!r}; it must be a number {'> 0' if above_0 else '>= 0'}"
            )
    if (out["longest_new_tokens"] or 0) > out["token_steps"]:
        raise ValueError(
            f"inputs: longest_new_tokens {out['longest_new_tokens']} is more than token_steps"
        )
    if out["mean_new_tokens"] > out["token_steps"]:
        raise ValueError(
            f"inputs: mean_new_tokens {out['mean_new_tokens']} is more than token_steps"
        )
    try:
        points = sorted((float(b), float(s)) for b, s in out["t_token"])
    except (TypeError, ValueError):
        points = []
    if (
        not points
        or points[0][0] <= 0
        or min(s for _, s in points) < 0
        or len({b for b, _ in points}) < len(points)
    ):
        raise ValueError(
            "inputs: t_token must be [[batch > 0, seconds >= 0], ...], one point a batch"
        )
    out["t_token"] = points
    if out["reward_side"] not in ("rollout", "trainer"):
        raise ValueError(
            f'inputs: reward_side {out["reward_side"]!r} is not "rollout" or "trainer"'
        )
    return out


def t_token(points: list, batch: float) -> float:
    """Seconds per decode step at ``batch`` sequences: piecewise-linear over sorted (batch, seconds)
    points, flat below the first, the last segment extended above the last."""
    if batch <= points[0][0] or len(points) == 1:
        return points[0][1]
    # past the end: extended
    i = next((i for i in range(1, len(points)) if batch <= points[i][0]), len(points) - 1)
    (b0, s0), (b1, s1) = points[i - 1], points[i]
    return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)


def longest(inp: dict, samples: int) -> float:
    """Decode steps of a generate call of ``samples`` samples: it runs until its longest sample
    ends. From an empirical length distribution: the expected longest of ``samples`` draws, sum over
    lengths x of x (F(x)^n - F(x-)^n); else longest_new_tokens, else token_steps (every call reaches
    the limit)."""
    lengths = inp["lengths"]
    if lengths is None:
        return inp["longest_new_tokens"] or inp["token_steps"]
    n, expected, below = len(lengths), 0.0, 0.0
    for i, x in enumerate(lengths):
        if i + 1 < n and lengths[i + 1] == x:
            continue
        cdf = (i + 1) / n
        expected += x * (cdf**samples - below**samples)
        below = cdf
    return expected


def generate_s(inp: dict, ranks: int) -> float:
    """One generate call on each of ``ranks`` ranks, the samples split evenly (the fullest rank sets
    the pace): as many decode steps as its longest sample, at the batch a decode step sees on
    average."""
    per_rank = math.ceil(inp["samples_per_step"] / ranks)
    steps = longest(inp, per_rank)
    active = per_rank * inp["mean_new_tokens"] / steps
    return inp["generate_overhead_s"] + steps * t_token(inp["t_token"], active)


def train_s(inp: dict, ranks: int, per_sample: float) -> float:
    efficiency = inp["train_efficiency"] if ranks > 1 else 1.0
    return inp["samples_per_step"] * per_sample / (ranks * efficiency)


def predict(
    inputs: dict,
    placement: str,
    world: int,
    rollout_ranks: int = 0,
    staleness: int = 0,
    continuous: bool = False,
) -> Prediction:
    """The steady-state step of ``placement`` ("colocated" or "split") on ``world`` ranks; the
    module docstring gives the formulas."""
    inp = check_inputs(inputs)
    trainers = world if placement == "colocated" else world - rollout_ranks
    generators = world if placement == "colocated" else rollout_ranks
    if (
        placement not in ("colocated", "split")
        or not 1 <= trainers <= world
        or generators < 1
        or staleness < 0
    ):
        raise ValueError(
            f"no {placement} layout with W = {world}, K = {rollout_ranks}, S = {staleness}"
        )
    phases = {
        "rollout": generate_s(inp, generators),
        "reward": inp["reward_s"],
        "logprob": train_s(inp, trainers, inp["logprob_s_per_sample"]),
        "update": train_s(inp, trainers, inp["train_s_per_sample"]),
    }
    gen, train = phases["rollout"] + phases["reward"], phases["logprob"] + phases["update"]
    if placement == "colocated":
        phases["sync"] = inp["sync_s"]
        step = gen + train + phases["sync"]
        idle_t, idle_r, rollout_ranks, staleness = gen, train, 0, 0
    else:
        phases["sync"] = inp["split_sync_s"]
        if inp["reward_side"] == "trainer":
            gen, train = gen - phases["reward"], train + phases["reward"]
        if continuous and staleness > 0:
            step, idle_t, idle_r = _continuous_step(
                inp, generators, staleness, gen - phases["rollout"], train, phases
            )
        else:
            busy = gen + train if staleness == 0 else max(gen, train)
            step = busy + phases["sync"]
            idle_t, idle_r = (gen, train) if staleness == 0 else (busy - train, busy - gen)
    n = inp["samples_per_step"]
    return Prediction(
        placement,
        world,
        rollout_ranks,
        staleness,
        step,
        n / step,
        idle_t / step,
        idle_r / step,
        phases,
    )


def _continuous_step(
    inp: dict, ranks: int, staleness: int, reward: float, train: float, phases: dict
) -> tuple[float, float, float]:
    """Split S >= 1 with continuous generation: (step s, trainer idle s, rollout idle s), from
    ``simulate_continuous``."""
    run = simulate_continuous(inp, ranks, staleness, reward, train, phases["sync"])
    phases["rollout"] = run.decode_s
    return run.step_s, run.trainer_idle_s, run.rollout_idle_s


@dataclass(frozen=True)
class ContinuousRun:
    step_s: float  # the trainer's mean step over the steady steps
    decode_s: float  # a rollout rank's decoding seconds a step
    rows_mean: float  # rows a decode step decodes, on average
    trainer_idle_s: float  # the trainer's wait for a batch, a step
    rollout_idle_s: float  # a rollout rank's wait for a go-ahead, a step


class _Engine:
    """One rollout rank's running batch, event by event: rows decode one token a decode step (its
    cost t_token(rows)), a row leaves after its drawn length, a step's share is done when its last
    row leaves (then scored: ``reward`` s), and an opened step's rows join while there is room."""

    def __init__(self, inp: dict, per_rank: int, capacity: int, reward: float, draw) -> None:
        self.inp, self.per_rank, self.capacity, self.reward = inp, per_rank, capacity, reward
        self.draw, self.clock, self.decoded = draw, 0.0, 0
        self.ends: list[tuple[int, int]] = []  # heap of (decode step it ends after, step)
        self.left: dict[int, int] = {}  # step -> its rows still running or waiting
        self.waiting: list[int] = []  # steps opened, rows not all admitted: [step, rows to admit]
        self.done: dict[int, float] = {}  # step -> when its share was scored
        self.decode_s = self.idle_s = self.row_steps = 0.0

    def open(self, step: int, at: float, load_s: float) -> None:
        """The go-ahead of ``step`` (new weights, loaded in ``load_s``) reaches the engine at
        ``at``; taken at the next decode step's boundary."""
        if not self.ends:
            self.idle_s += max(0.0, at - self.clock)
        self.clock = max(self.clock, at) + load_s
        self.left[step] = self.per_rank
        self.waiting.append([step, self.per_rank])
        self._admit()

    def _admit(self) -> None:
        while self.waiting and len(self.ends) < self.capacity:
            step_rows = self.waiting[0]
            n = min(step_rows[1], self.capacity - len(self.ends))
            for _ in range(n):
                heapq.heappush(self.ends, (self.decoded + self.draw(), step_rows[0]))
            step_rows[1] -= n
            if not step_rows[1]:
                self.waiting.pop(0)

    def run_until(self, at: float, step: int | None = None) -> None:
        """Decode whole decode steps while one starts before ``at`` (or, given ``step``, until that
        step's share is scored)."""
        while self.ends and self.clock < at and step not in self.done:
            rows, next_end = len(self.ends), self.ends[0][0]
            cost = t_token(self.inp["t_token"], rows)
            steps = next_end - self.decoded
            if at < math.inf and cost > 0:
                steps = min(steps, max(1, math.ceil((at - self.clock) / cost)))
            self.clock += steps * cost
            self.decode_s += steps * cost
            self.row_steps += steps * rows
            self.decoded += steps
            while self.ends and self.ends[0][0] <= self.decoded:
                _, ended = heapq.heappop(self.ends)
                self.left[ended] -= 1
                if not self.left[ended]:
                    self.clock += self.reward
                    self.done[ended] = self.clock
            self._admit()


def simulate_continuous(
    inp: dict,
    ranks: int,
    staleness: int,
    reward: float,
    train: float,
    sync: float,
    steps: int = 200,
    skip: int = 20,
    seed: int = 0,
) -> ContinuousRun:
    """Continuous generation on ``ranks`` rollout ranks, step by step. Each rank keeps a running
    batch of up to capacity_rows rows (default: every row of the S+1 steps it may hold); the
    go-ahead of step j comes with the weights of step j-1-S, once the trainer has trained it and
    sent them (``sync`` s) and the rank loads them between two decode steps (weight_load_s); a
    step's rows draw their lengths from ``lengths`` (seeded) and join as there is room; the trainer
    trains step j (``train`` s) once every rank's share of it is scored. The step: the trainer's
    mean over steps ``skip``..``steps``."""
    if inp["lengths"] is None:
        raise ValueError("inputs: continuous generation needs lengths (a length distribution)")
    rng = random.Random(seed)
    lengths = inp["lengths"]
    per_rank = math.ceil(inp["samples_per_step"] / ranks)
    capacity = int(inp["capacity_rows"] or per_rank * (staleness + 1))
    engines = [
        _Engine(inp, per_rank, capacity, reward, lambda: round(rng.choice(lengths)))
        for _ in range(ranks)
    ]
    for step in range(1, staleness + 2):  # version 0's go-aheads
        for engine in engines:
            engine.open(step, 0.0, 0.0)
    trained, waited, at_skip = [0.0], 0.0, (0.0, 0.0, 0.0, 0)
    for step in range(1, steps + 1):
        for engine in engines:
            engine.run_until(math.inf, step)
            if step not in engine.done:
                raise ValueError(f"the model's engine stalled before step {step}")
        arrived = max(engine.done[step] for engine in engines)
        if step > skip:
            waited += max(0.0, arrived - trained[-1])
        trained.append(max(arrived, trained[-1]) + train + sync)
        for engine in engines:  # weights of `step`: the go-ahead of step + S + 1
            engine.run_until(trained[-1])
            engine.open(step + staleness + 1, trained[-1], inp["weight_load_s"])
        if step == skip:
            at_skip = _totals(engines)
    steady = steps - skip
    decode, idle, row_steps, decoded = (
        end - start for end, start in zip(_totals(engines), at_skip, strict=True)
    )
    return ContinuousRun(
        (trained[-1] - trained[skip]) / steady,
        decode / ranks / steady,
        row_steps / max(decoded, 1),
        waited / steady,
        idle / ranks / steady,
    )


def _totals(engines: list[_Engine]) -> tuple[float, float, float, int]:
    """The engines' decoding s, idle s, row-steps and decode steps so far, summed."""
    return (
        sum(e.decode_s for e in engines),
        sum(e.idle_s for e in engines),
        sum(e.row_steps for e in engines),
        sum(e.decoded for e in engines),
    )


def table(rows: list[list], header: list[str]) -> str:
    """Columns of numbers (and percentages) right-aligned, of words left-aligned."""
    cells = [header, *[[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [
        all(isinstance(r[i], (int, float)) or str(r[i]).endswith("%") for r in rows)
        for i in range(len(header))
    ]
    return "\n".join(
        "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)
        ).rstrip()
        for r in cells
    )


HEADER = ["placement", "W", "K", "S", "step s", "samples/s", "trainer idle", "rollout idle"]


def row(p: Prediction) -> list:
    return [
        p.placement,
        p.world,
        p.rollout_ranks,
        p.staleness,
        p.step_s,
        p.samples_per_s,
        f"{p.trainer_idle:.0%}",
        f"{p.rollout_idle:.0%}",
    ]


def compare(inputs: dict, measured: dict) -> tuple[str, bool]:
    """The per-row comparison table of a --measured file's runs and whether every row is within
    TOLERANCE."""
    rows, ok = [], True
    for run in measured["runs"]:
        given = {
            **inputs,
            **run.get("inputs", {}),
            **({"samples_per_step": run["samples_per_step"]} if "samples_per_step" in run else {}),
        }
        p = predict(
            given,
            run["placement"],
            run["world"],
            run.get("rollout_ranks", 0),
            run.get("staleness", 0),
            run.get("continuous", False),
        )
        error = (p.step_s - run["step_s"]) / run["step_s"]
        ok &= abs(error) <= TOLERANCE
        phases = " ".join(
            f"{k} {p.phases.get(k, 0):.3g}/{v:.3g}" for k, v in run.get("phases", {}).items()
        )
        rows.append(
            [
                p.placement + (" continuous" if run.get("continuous") else ""),
                p.world,
                p.rollout_ranks,
                p.staleness,
                p.step_s,
                float(run["step_s"]),
                f"{error:+.1%}",
                "ok" if abs(error) <= TOLERANCE else "OFF",
                phases,
            ]
        )
    header = [
        "placement",
        "W",
        "K",
        "S",
        "predicted s",
        "measured s",
        "error",
        f"±{TOLERANCE:.0%}",
        "phases predicted/measured s",
    ]
    return table(rows, header), ok


# --published (sources in the module docstring). The derived inputs use Llama-3.1-8B's 8.03e9
# parameters, the H100 SXM's 989e12 dense bf16 FLOP/s (datasheet) at an assumed MFU, and
# 1,071 tokens a sample.
NEMO = "NeMo-RL v0.5 performance summary"
RECIPE = "NeMo-RL recipe grpo-llama3.1-8b-instruct-2n8g"
_PARAMS, _TOKENS, _MFU = 8.03e9, 1071, 0.40
_FLOPS = 989e12 * _MFU
PUBLISHED_INPUTS = [  # (key, value, provenance, how)
    ("world", 16, f"measured ({NEMO})", "16 GPUs in both rows"),
    (
        "rollout_ranks",
        8,
        "measured (NeMo-RL recipe async-grpo-llama3.1-8b-instruct-2n8g)",
        "generation not colocated: 1 node of 8 GPUs",
    ),
    ("staleness", 1, f"measured ({NEMO})", "1-step off"),
    ("samples_per_step", 2048, f"measured ({RECIPE})", "64 prompts x 32 generations (G-GBS 2,048)"),
    (
        "token_steps",
        4096,
        f"measured ({RECIPE})",
        "max_new_tokens 4,096: some sample of a rank reaches it",
    ),
    (
        "mean_new_tokens",
        _TOKENS,
        f"measured ({NEMO})",
        "mean of G-average seq len 1,019 and 1,123, prompt included",
    ),
    (
        "t_token",
        [[1, 0.007], [8, 0.007], [512, 0.007 + 504 * 6e-5]],
        "assumed",
        "7 ms a decode step up to 8 sequences (16 GB of weights at 3.35 TB/s, plus vLLM's "
        "overhead), +0.06 ms a sequence (16 GFLOP at ~50% of 989 "
        "TFLOP/s, ~600 tokens of KV cache at 128 KiB a token)",
    ),
    ("generate_overhead_s", 1.0, "assumed", "prefill and scheduling per generate call"),
    (
        "train_s_per_sample",
        6 * _PARAMS * _TOKENS * 4 / 3 / _FLOPS,
        "assumed",
        f"6 x params x tokens x 4/3 (activation checkpointing, in the recipe) at {_MFU:.0%} MFU",
    ),
    (
        "logprob_s_per_sample",
        2 * 2 * _PARAMS * _TOKENS / _FLOPS,
        "assumed",
        "2 forward passes (previous and reference policy) "
        f"of 2 x params x tokens at {_MFU:.0%} MFU",
    ),
    ("train_efficiency", 1.0, "assumed", "data parallel over 8 or 16 GPUs at the same MFU"),
    (
        "reward_s",
        1.0,
        "assumed",
        "math answer checks of 2,048 samples, scored on the generation side",
    ),
    ("sync_s", 2.0, "assumed", "16 GB of bf16 weights into the colocated vLLM engine"),
    (
        "split_sync_s",
        2.0,
        "assumed",
        "16 GB broadcast from the training node to the generation node",
    ),
]
# NEMO's step s and tokens/s/GPU
PUBLISHED_STEPS = {"colocated": (92.8, 1581), "split": (64.8, 2478)}


def published() -> str:
    inputs = {k: v for k, v, _, _ in PUBLISHED_INPUTS}
    lines = [
        table(
            [
                [k, json.dumps(v) if isinstance(v, list) else v, src, how]
                for k, v, src, how in PUBLISHED_INPUTS
            ],
            ["input", "value", "provenance", "how"],
        ),
        "",
    ]
    rows, ours = [], [predict(inputs, "colocated", 16), predict(inputs, "split", 16, 8, 1)]
    for p in ours:
        step, tokens = PUBLISHED_STEPS[p.placement]
        rows.append(
            [
                *row(p),
                step,
                f"{(p.step_s - step) / step:+.0%}",
                round(p.samples_per_s * _TOKENS / 16),
                tokens,
            ]
        )
    lines.append(table(rows, [*HEADER, "published s", "error", "tokens/s/GPU", "published"]))
    speedup = PUBLISHED_STEPS["colocated"][0] / PUBLISHED_STEPS["split"][0]
    lines += [
        f"split over colocated: predicted {ours[0].step_s / ours[1].step_s:.2f}x, published "
        f"{speedup:.2f}x. No input is fitted to the published step times.",
        f"tokens/s/GPU here = samples/s x {_TOKENS:,} tokens / 16 GPUs; the published ones do not "
        "follow from the page's step times this way (2,048 x 1,019 / 92.8 / 16 = "
        f"{2048 * 1019 / 92.8 / 16:,.0f}, not 1,581: the page averages 5 steps).",
    ]
    return "\n".join(lines)


# --long-tail: continuous against batch-by-batch generation on 8 GPUs, split 4 + 4, S = 1. Every
# input is an assumption, stated in LONG_TAIL_ASSUMED; the anchors' figures come from
# github.com/Tencent-Hunyuan/UniRL/issues/94 (which quotes verl's).
LONG_TAIL_SAMPLES, LONG_TAIL_CAP, LONG_TAIL_PROMPT = 2048, 8192, 200
LONG_TAIL_ASSUMED = [
    "8 H100-class GPUs: rollout.ranks 4 (one vLLM engine each), 4 ZeRO-3 trainer ranks",
    f"{LONG_TAIL_SAMPLES:,} samples a step (128 prompts x 16), max_new_tokens {LONG_TAIL_CAP:,}, "
    f"{LONG_TAIL_PROMPT} prompt tokens",
    "completion lengths: log-normal, median 1,000 tokens, sigma 0.9 (mean ~1,500; ~1% at the "
    "cap), as 400 quantiles",
    "t_token(b) = 3 ms + 2 x params bytes / 3.35 TB/s + b x 6e-5 s x params / 8.03e9 (the "
    "--published inputs' 7 ms and 0.06 ms a sequence at 8B, scaled by size)",
    "train and log-prob costs: 6 x params x tokens x 4/3 and 2 x 2 x params x tokens at 40% of "
    "989 TFLOP/s; reward 1 s on the rollout side; sync: 2 x params bytes at 25 GB/s",
]
LONG_TAIL_ANCHORS = [
    "verl (as quoted in UniRL#94): one step off, overlap alone, +23% (FSDP2) / +40% (Megatron); "
    "fully async with partial rollout, 2.35-2.67x",
    "UniRL#94: async overlap alone gave no measurable speedup on its generate-dominated step; a "
    "straggler decodes at ~1/10 of saturated throughput",
]


def long_tail_lengths(count: int = 400) -> list[float]:
    from statistics import NormalDist

    normal = NormalDist(math.log(1000), 0.9)
    return [
        min(LONG_TAIL_CAP, max(1.0, math.exp(normal.inv_cdf((i + 0.5) / count))))
        for i in range(count)
    ]


def long_tail_inputs(params: float) -> dict:
    lengths = long_tail_lengths()
    tokens = LONG_TAIL_PROMPT + sum(lengths) / len(lengths)
    flops = 989e12 * 0.40
    floor = 3e-3 + 2 * params / 3.35e12
    per_sequence = 6e-5 * params / 8.03e9
    return {
        "samples_per_step": LONG_TAIL_SAMPLES,
        "token_steps": LONG_TAIL_CAP,
        "lengths": lengths,
        "t_token": [[1, floor + per_sequence], [1024, floor + 1024 * per_sequence]],
        "train_s_per_sample": 6 * params * tokens * 4 / 3 / flops,
        "logprob_s_per_sample": 2 * 2 * params * tokens / flops,
        "reward_s": 1.0,
        "sync_s": 2 * params / 25e9,
        "world": 8,
        "rollout_ranks": 4,
    }


def _long_tail_row(name: str, staleness: int, batch: Prediction, flowing: Prediction) -> list:
    return [
        name,
        staleness,
        batch.step_s,
        flowing.step_s,
        f"{flowing.step_s / batch.step_s:.2f}",
        f"{batch.trainer_idle:.0%}",
        f"{flowing.trainer_idle:.0%}",
    ]


def long_tail() -> str:
    rows = []
    for name, params in (("0.5B", 0.49e9), ("1.5B", 1.54e9), ("7B", 7.6e9)):
        inputs = long_tail_inputs(params)
        for staleness in (1, 2, 4):
            batch = predict(inputs, "split", 8, 4, staleness)
            flowing = predict(inputs, "split", 8, 4, staleness, continuous=True)
            rows.append(_long_tail_row(name, staleness, batch, flowing))
    header = [
        "policy",
        "S",
        "batch-by-batch step s",
        "continuous step s",
        "continuous / batch",
        "trainer idle, batch",
        "trainer idle, continuous",
    ]
    return "\n".join(
        [
            table(rows, header),
            "",
            "assumed (no input measured or fitted):",
            *(f"- {a}" for a in LONG_TAIL_ASSUMED),
            "the anchors' figures (other systems, other shapes):",
            *(f"- {a}" for a in LONG_TAIL_ANCHORS),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--inputs", type=Path, help="JSON file of the model's inputs (keys in the text above)"
    )
    parser.add_argument("--world", type=int, help="W, every launched rank")
    parser.add_argument(
        "--rollout-ranks", type=int, nargs="+", help="K, the ranks that only generate (split)"
    )
    parser.add_argument("--staleness", type=int, help="S of the split row printed besides S = 0")
    parser.add_argument(
        "--measured", type=Path, help="compare with bench_placement.py's JSON; exit 1 beyond ±15%%"
    )
    parser.add_argument(
        "--published", action="store_true", help="the published GPU setup beside the model"
    )
    parser.add_argument(
        "--long-tail",
        action="store_true",
        help="continuous vs batch-by-batch generation at stated GPU shapes",
    )
    args = parser.parse_args(argv)
    try:
        if args.published:
            print(published())
            return 0
        if args.long_tail:
            print(long_tail())
            return 0
        measured = json.loads(args.measured.read_text()) if args.measured else None
        raw = json.loads(args.inputs.read_text()) if args.inputs else (measured or {}).get("inputs")
        if raw is None:
            parser.error('--inputs is needed (or a --measured file with an "inputs" object)')
        inp = check_inputs(raw)
        if measured is not None:
            text, ok = compare(raw, measured)
            print(f"machine: {measured.get('machine', '?')}\n{text}")
            return 0 if ok else 1
        world = args.world or inp["world"]
        stale = inp["staleness"] if args.staleness is None else args.staleness
        rows = [row(predict(raw, "colocated", world))]
        for k in args.rollout_ranks or [inp["rollout_ranks"]]:
            rows += [row(predict(raw, "split", world, k, s)) for s in sorted({0, stale})]
        print(table(rows, HEADER))
        return 0
    except (ValueError, KeyError, OSError) as e:
        print(
            f"error: simulate_placement: {'a run lacks ' if isinstance(e, KeyError) else ''}{e}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
