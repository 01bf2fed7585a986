"""Continuous against batch-by-batch generation on a long tail of completion lengths (issue 52): the
long-tail case of benchmarks/bench_placement.py.

    python benchmarks/bench_placement.py --long-tail --steps 100 --skip 10 [--record]

Eight launches, one after the other, through the vLLM environment's deepspeed launcher with 2 ranks
pinned one core each (as bench_placement's other cases): split placement, 1 trainer rank + 1
rollout rank, staleness 1 (the target's) and 2, with the hf engine and with vLLM's CPU build, each
batch by batch (rollout.continuous false) and continuous (true).

The tail. The policy is builtin:tiny's random model (recipes/tiny_vllm_cpu.json's shape) saved to a
folder whose generation_config.json adds two stop tokens, "!" and "?", to EOS: at temperature 1.5
about 3% of its tokens stop a completion, so lengths fall roughly geometrically (measured before
training: mean ~31, median 20, 90th percentile 72 of max_new_tokens 128, a few at the limit). A
batch-by-batch generate call decodes until its longest sample ends, with its batch shrinking to a
few rows; a continuous engine fills the rows that free up with the next step's groups. The reward
is the first character's parity (a signal from the first step, which leaves the lengths alone), so
the two modes' learning can be compared: last-10 mean rewards within noise (twice the standard error
of their difference over those steps).

The table: per engine, S and mode the mean step (time_step_s over the steady steps), the rollout
rank's decode seconds a step and a decode step's cost, the mean running batch (rows decoded per
decode step), mean and longest completion, the fraction of samples spanning a weight update, and the
last-10 reward. The target: continuous <= 0.8 x batch-by-batch's step on each engine, with the same
learning. The hf engine's two modes decode with different loops (transformers' generate, and
grpo_ds's own running batch, which costs less a decode step), so its ratio holds both effects;
vLLM's two modes decode with the same engine, and its ratio is the refill's alone. Then the
placement model (benchmarks/simulate_placement.py --measured) predicts each run's step from its
measured costs (a decode step's: batch by batch one figure, continuous a + b x rows fitted over the
run's batches; the completion lengths, a geometric tail with the measured mean; training, reward,
sync and weight load), simulating the continuous runs step by step: its target, every row within
+-15%.

Run it with --steps 100 --skip 10: a continuous run's step comes in bursts and its lengths are
random, so 30 steps' mean moves by 10% from one launch to the next.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path

STOPS = "!?"  # stop tokens beside EOS: about 3% of the random policy's tokens
STEPS, SKIP = 100, 10
SAMPLES = 2 * 16
LIMIT = 128  # rollout.max_new_tokens
SHAPE = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=16",
    f"rollout.max_new_tokens={LIMIT}",
    "train.micro_batch_samples_per_gpu=32",
    "train.logprob_micro_batch_samples_per_gpu=32",
    'reward.functions=[{"name": "long_tail_rewards:first_odd"}]',
    'rollout.placement="split"',
    "rollout.ranks=1",
]
REWARDS = """def first_odd(*, completions, **kwargs):
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]
"""
TARGET = 0.8  # continuous step / batch-by-batch step, at S = 1
ENGINES = ("hf", "vllm")
# (engine, continuous, S): the target's S = 1, and S = 2 beside it (more steps in flight)
CASES = [(e, c, s) for e in ENGINES for s in (1, 2) for c in (False, True)]


def write_policy(folder: Path) -> Path:
    """builtin:tiny's model as tiny_vllm_cpu.json shapes it, with "!" and "?" stopping a
    completion beside EOS (its generation_config.json)."""
    from safetensors.torch import save_model

    from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, seed=0)
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(STOPS))]
    model.generation_config.eos_token_id = stops
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder


def case_name(engine: str, continuous: bool, staleness: int) -> str:
    return f"{engine}_s{staleness}_{'continuous' if continuous else 'batch'}"


def summarize(metrics: list[dict], skip: int) -> dict:
    """A run's steady steps (after the first ``skip``) and its last 10."""
    steps = [m for m in metrics if m["step"] > skip]
    last = [m["reward_mean"] for m in metrics[-10:]]

    def mean(key: str, default: float = 0.0) -> float:
        return statistics.fmean(m.get(key, default) for m in steps)

    decode = mean("rollout_side/time_rollout_s")
    tokens = mean("response_len_mean") * SAMPLES
    running = mean("rollout/running_rows_mean")
    return {
        # the mean, not the median: continuous steps come in bursts (two batches at once, then a
        # wait), whose median says little of the steps a second
        "step_s": mean("time_step_s"),
        "decode_s": decode,
        # batch by batch: one generate call a step, as many decode steps as its longest sample
        "decode_steps": tokens / running if running else mean("response_len_max"),
        "running_rows": running or tokens / mean("response_len_max"),
        "decode_cost": decode_cost(steps) if running else None,
        "mean_len": mean("response_len_mean"),
        "longest_len": mean("response_len_max"),
        "spanning": mean("placement/samples_spanning_update_frac"),
        "staleness": mean("placement/staleness_mean"),
        "reward_last10": statistics.fmean(last),
        "reward_se": statistics.stdev(last) / math.sqrt(len(last)),
        "update_s": statistics.median(m["time_update_s"] for m in steps),
        "logprob_s": statistics.median(m.get("time_logprob_s", 0.0) for m in steps),
        "sync_s": statistics.median(m.get("time_sync_s", 0.0) for m in steps),
        "load_s": statistics.median(m.get("rollout_side/time_sync_s", 0.0) for m in steps),
        "reward_s": statistics.median(m["rollout_side/time_reward_s"] for m in steps),
    }


def decode_cost(steps: list[dict]) -> tuple[float, float] | None:
    """A continuous run's cost of a decode step as a + b x its rows, in seconds: least squares
    over its batches' decoding seconds against their decode steps n and row-steps r (from
    rollout/tokens_per_s = r / seconds and rollout/running_rows_mean = r / n): d = a n + b r. None
    when the batches do not pin both down (every batch at one running batch)."""
    points = []
    for m in steps:
        seconds, rows = m["rollout_side/time_rollout_s"], m.get("rollout/running_rows_mean", 0.0)
        if seconds > 0 and rows > 0:
            row_steps = m["rollout/tokens_per_s"] * seconds
            points.append((row_steps / rows, row_steps, seconds))
    nn = sum(n * n for n, _, _ in points)
    nr = sum(n * r for n, r, _ in points)
    rr = sum(r * r for _, r, _ in points)
    nd = sum(n * d for n, _, d in points)
    rd = sum(r * d for _, r, d in points)
    det = nn * rr - nr * nr
    if len(points) < 3 or det <= 1e-12 * nn * rr:
        return None
    a, b = (nd * rr - rd * nr) / det, (rd * nn - nd * nr) / det
    return (a, b) if a > 0 and b >= 0 else None


def geometric_lengths(mean: float, limit: int, count: int = 400) -> list[int]:
    """``count`` quantiles of the completion lengths of a policy that stops each token with one
    probability p, cut at ``limit`` (the long-tail policy's stop tokens): p is the one whose
    mean length, (1 - (1 - p)^limit) / p, is ``mean``."""
    low, high = 1e-9, 1.0
    for _ in range(100):  # the mean falls as p rises
        p = (low + high) / 2
        low, high = (p, high) if (1 - (1 - p) ** limit) / p > mean else (low, p)
    return [
        min(limit, max(1, math.ceil(math.log(1 - (i + 0.5) / count) / math.log(1 - p))))
        for i in range(count)
    ]


def measured(engine: str, results: dict, machine: str, commit: str) -> dict:
    """simulate_placement's --measured file for one engine's runs. What the model takes as
    measured: each run's cost of a decode step (batch by batch: its decode seconds over its decode
    steps, one figure; continuous: a + b x rows from its batches, decode_cost), the completion
    lengths (a geometric tail cut at max_new_tokens with the engine's measured mean), the training,
    reward, sync and weight-load costs; what it predicts: each run's step."""
    mine = {key: r for key, r in results.items() if key[0] == engine}
    first = mine[(engine, False, 1)]
    mean_len = statistics.fmean(r["mean_len"] for r in mine.values())
    inputs = {
        "samples_per_step": SAMPLES,
        "token_steps": LIMIT,
        "mean_new_tokens": mean_len,
        "longest_new_tokens": statistics.fmean(r["longest_len"] for r in mine.values()),
        "lengths": geometric_lengths(mean_len, LIMIT),
        "t_token": [[1, first["decode_s"] / first["decode_steps"]]],
        "train_s_per_sample": first["update_s"] / SAMPLES,
        "logprob_s_per_sample": first["logprob_s"] / SAMPLES,
        "reward_s": first["reward_s"],
        "sync_s": first["sync_s"],
        "world": 2,
        "rollout_ranks": 1,
    }
    return {
        "machine": f"{machine} ({engine})",
        "commit": commit,
        "inputs": inputs,
        "runs": [
            _measured_run(continuous, staleness, r)
            for (_, continuous, staleness), r in mine.items()
        ],
    }


def _measured_run(continuous: bool, staleness: int, r: dict) -> dict:
    if r["decode_cost"] is None:
        cost = [[1, r["decode_s"] / r["decode_steps"]]]
    else:
        a, b = r["decode_cost"]
        cost = [[1, a + b], [SAMPLES * (staleness + 1), a + b * SAMPLES * (staleness + 1)]]
    return {
        "placement": "split",
        "world": 2,
        "rollout_ranks": 1,
        "staleness": staleness,
        "continuous": continuous,
        "step_s": r["step_s"],
        "samples_per_step": SAMPLES,
        "inputs": {"t_token": cost, "weight_load_s": r["load_s"]},
        "phases": {"rollout": r["decode_s"], "reward": r["reward_s"], "sync": r["sync_s"]},
    }


def table(results: dict) -> str:
    from common import fmt, markdown_table

    headers = [
        "engine",
        "S",
        "generation",
        "step s (mean)",
        "decode s a step",
        "ms a decode step",
        "running rows (mean)",
        "completion mean / longest",
        "samples spanning an update",
        "staleness (mean)",
        "reward, last 10",
    ]
    rows = [
        [
            engine,
            str(staleness),
            "continuous" if continuous else "batch by batch",
            fmt(r["step_s"], 3),
            fmt(r["decode_s"], 3),
            fmt(1000 * r["decode_s"] / r["decode_steps"], 2),
            fmt(r["running_rows"], 1),
            f"{r['mean_len']:.1f} / {r['longest_len']:.0f}",
            f"{r['spanning']:.0%}",
            fmt(r["staleness"], 2),
            f"{r['reward_last10']:.3f} ± {r['reward_se']:.3f}",
        ]
        for (engine, continuous, staleness), r in results.items()
    ]
    return markdown_table(headers, rows)


def verdicts(results: dict) -> list[tuple[str, bool | None]]:
    """Per engine at S = 1: the step ratio against TARGET, and the learning within noise; at S = 2
    the step ratio beside them (no target)."""
    out = []
    for engine in ENGINES:
        batch, flowing = results[(engine, False, 1)], results[(engine, True, 1)]
        ratio = flowing["step_s"] / batch["step_s"]
        gap = abs(flowing["reward_last10"] - batch["reward_last10"])
        noise = 2 * math.hypot(batch["reward_se"], flowing["reward_se"])
        out.append(
            (
                f"{engine}, S=1: continuous / batch-by-batch step {ratio:.3f} (target <= "
                f"{TARGET}, lower is faster)",
                ratio <= TARGET,
            )
        )
        out.append(
            (
                f"{engine}, S=1: last-10 reward continuous - batch by batch "
                f"{flowing['reward_last10'] - batch['reward_last10']:+.3f}, noise (2 standard "
                f"errors) {noise:.3f} (target: the same learning, |difference| <= noise)",
                gap <= noise,
            )
        )
        two = results[(engine, True, 2)]["step_s"] / results[(engine, False, 2)]["step_s"]
        out.append((f"{engine}, S=2: continuous / batch-by-batch step {two:.3f}", None))
    return out


def run(args, launch, simulate) -> None:
    """The four launches (``launch(out, name, overrides, port) -> metrics``), the table, the
    model's check (``simulate(measured file) -> (text, ok)``), reported by common.report."""
    from common import commit, machine, report, verdict

    results, model_text, model_ok = {}, [], True
    with tempfile.TemporaryDirectory(prefix="bench_long_tail_") as tmp:
        folder = Path(tmp)
        policy = write_policy(folder / "policy")
        (folder / "long_tail_rewards.py").write_text(REWARDS)
        shape = [*SHAPE, f"model.path={policy}", f"train.steps={args.steps}", *args.overrides]
        for i, (engine, continuous, staleness) in enumerate(CASES):
            name = case_name(engine, continuous, staleness)
            overrides = [
                *shape,
                f"rollout.engine={engine}",
                f"rollout.continuous={json.dumps(continuous)}",
                f"rollout.max_staleness={staleness}",
            ]
            metrics = launch(folder, name, overrides, args.port + i, str(folder))
            results[(engine, continuous, staleness)] = summarize(metrics, args.skip)
        for engine in ENGINES:
            file = folder / f"measured_{engine}.json"
            file.write_text(json.dumps(measured(engine, results, machine("cpu"), commit())))
            text, ok = simulate(file)
            model_text.append(text)
            model_ok &= ok
    body = (
        table(results)
        + "\n\nThe placement model (`benchmarks/simulate_placement.py --measured`) against these "
        "runs, per engine:\n\n"
        + "\n\n".join("\n".join("    " + line for line in t.splitlines()) for t in model_text)
    )
    notes = [
        f"recipes/tiny_vllm_cpu.json with {' '.join(SHAPE)}, model.path = its random policy saved "
        f'with "{STOPS}" as stop tokens beside EOS (benchmarks/long_tail.py), '
        f"train.steps={args.steps}: 2 ranks pinned one core each (deepspeed --bind_cores_to_rank), "
        "1 trainer + 1 rollout rank; each case a fresh launch, one after the other",
        f"steady state: the first {args.skip} steps dropped; step s: the mean time_step_s (the "
        "trainer's step, its wait for the batch included; the mean, as continuous steps come in "
        "bursts); decode s: the rollout rank's decoding "
        "seconds between two batches; running rows: rows decoded per decode step (batch by batch: "
        "the step's tokens / its longest completion)",
        *(text if ok is None else f"{text}: {verdict(ok)}" for text, ok in verdicts(results)),
        "placement model: each run's cost of a decode step (continuous: a + b x rows over its "
        "batches), its completion lengths (a geometric tail with the measured mean), training, "
        "reward, sync and weight-load costs as measured (benchmarks/long_tail.py measured()); the "
        "step, which the pipeline sets, predicted (continuous: simulated step by step); target "
        "(every row within +-15% of the measured mean step): "
        f"{verdict(model_ok)}",
    ]
    report(
        "bench_placement",
        f"long tail: split batch by batch vs continuous, S=1 and 2, hf and vLLM, {args.steps} "
        "steps, cpu",
        "cpu",
        body,
        notes,
        args.record,
    )
