"""Do grpo_ds and TRL's GRPOTrainer compute the same update? One fixed batch, one optimizer step,
side by side.

    OMP_NUM_THREADS=1 PYTHONPATH=. /tmp/trlvenv/bin/python benchmarks/check_step_vs_trl.py
        [--record]

(any interpreter that imports grpo_ds, deepspeed and trl; about 10 s on one CPU thread; CPU only).
Both sides follow recipes/tiny_cpu.json (or --recipe), TRL through ``trl_config`` of
bench_vs_trl_runner.py, the mapping the benchmark uses, and both start from the same builtin tiny
model (run.seed). The batch is fixed and hand-made: every prompt of the dataset with ``group_size``
completions of 1-2 tokens (the answer + EOS, the answer + ".", a wrong digit + EOS, a lone EOS, two
wrong characters cut by the length limit), with a number of right answers that varies by prompt, so
most groups have mixed rewards.

grpo_ds: the trainer's own functions on that batch: rewards (grpo_ds.step.collect.score_functions),
advantages and the micro-batch plan (grpo_ds.step.advantage.advantages and
grpo_ds.step.plan.plan_recipe_step), and grpo_ds.step.update.optimizer_step on a DeepSpeed engine
built as grpo_ds.train builds it (world size 1: ZeRO stage 1 from the recipe's stage-3 file,
grpo_ds.config.deepspeed.one_rank_stage). The accumulated gradient is read just before the engine
steps, the weights just after.

TRL: a GRPOTrainer built as bench_vs_trl_runner.run_trl builds it, trained for one optimizer step
(max_steps=1) with its sampling replaced by the fixed completions (``_generate_single_turn``); the
rest is TRL's own path: prompt tokenisation, decoding, reward function, advantages, the shuffled
split into micro-batches, ``training_step`` (the loss normalisation across gradient accumulation),
clipping and the AdamW step. The accumulated gradient is read just before clipping, the weights
after the step.

A third run feeds TRL's advantages to grpo_ds's optimizer_step (on a plain torch module), which
separates a difference in the advantages from one in the loss and its normalisation.

Printed: per parameter group the gradient norm, the largest absolute and the relative gradient
difference, the least-squares scale of TRL's gradient on grpo_ds's (a constant factor shows up
here), the relative difference once the advantages are equal, the largest difference of the weight
change of the step (in units of the learning rate) and how many weights move more than 5 % of the
learning rate apart; then the losses, gradient norms, token normalisers, advantages, a check of both
optimizer steps against AdamW's first step, and a verdict.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import math
import os
import random
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
# this check runs on the CPU (and DeepSpeed then says nothing)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import common  # noqa: E402
import torch  # noqa: E402
from bench_vs_trl_runner import trl_config  # noqa: E402

from grpo_ds.config.deepspeed_keys import zero_stage  # noqa: E402
from grpo_ds.config.loading import load_recipe  # noqa: E402
from grpo_ds.config.recipe import Recipe  # noqa: E402
from grpo_ds.distributed.ranks import Dist  # noqa: E402
from grpo_ds.model.loading import load_model  # noqa: E402
from grpo_ds.rollout.base import Rollouts  # noqa: E402
from grpo_ds.run.preflight import Inputs, prepare_inputs  # noqa: E402
from grpo_ds.step.advantage import advantages as step_advantages  # noqa: E402
from grpo_ds.step.batch import StepBatch  # noqa: E402
from grpo_ds.step.collect import score_functions  # noqa: E402
from grpo_ds.step.context import StepContext  # noqa: E402
from grpo_ds.step.plan import plan_recipe_step  # noqa: E402
from grpo_ds.step.update import UpdateSettings, optimizer_step  # noqa: E402

# Right answers per group, cycled over the prompts: mostly mixed groups, some all wrong, some all
# right.
RIGHT_PER_GROUP = (0, 1, 3, 5, 8, 11, 13, 15, 16, 2, 6, 9)
ADAM_EPS = 1e-8  # both sides (grpo_ds.config.deepspeed, trl_config's adam_epsilon)
# a weight "moves apart" when the two steps differ by more than this fraction of the learning rate
APART = 0.05
NOISE = 1e-5  # relative gradient difference that float32 sums in another order can explain
# (prompt ids, completion ids) names a sample on both sides
Key = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class StepResult:
    """One side's optimizer step."""

    grads: dict[str, torch.Tensor]  # accumulated over the step's micro-batches, before clipping
    weights: dict[str, torch.Tensor]  # after the optimizer step
    loss: float  # sum of the micro-batches' losses
    grad_norm: float  # before clipping, as the side computes it
    advantages: dict[Key, float]
    micro_batches: int
    normaliser: float  # the token count the token-mean loss divides by


# ---------------------------------------------------------------------------------------- the batch


def completion_ids(answer: str, right: bool, rng: random.Random, tokenizer) -> list[int]:
    """1-2 tokens: a right answer ends in EOS or "."; a wrong one is EOS alone, a wrong digit + EOS,
    or 2 chars."""
    tok, eos = tokenizer.convert_tokens_to_ids, tokenizer.eos_token_id
    wrong = [c for c in "0123456789x+= " if c != answer]
    if right:
        return [tok(answer), eos] if rng.random() < 0.75 else [tok(answer), tok(".")]
    kind = rng.choice(("eos", "digit", "cut"))
    if kind == "eos":
        return [eos]
    if kind == "digit":
        return [tok(rng.choice(wrong)), eos]
    return [tok(rng.choice(wrong)), tok(rng.choice(wrong + [answer]))]


def fixed_rollouts(inputs: Inputs) -> Rollouts:
    """Every prompt once, ``group_size`` hand-made completions each (consecutive), as grpo_ds's
    rollout returns."""
    recipe, tokenizer = inputs.recipe, inputs.tokenizer
    G, rng = recipe.rollout.group_size, random.Random(0)
    prompt_ids, response_ids = [], []
    for p, row in enumerate(inputs.prompts):
        answer = str(row.columns[recipe.data.answer_key])
        flags = [j < RIGHT_PER_GROUP[p % len(RIGHT_PER_GROUP)] for j in range(G)]
        rng.shuffle(flags)
        for right in flags:
            prompt_ids.append(list(row.prompt_ids))
            response_ids.append(completion_ids(answer, right, rng, tokenizer))
    finish = ["stop" if r[-1] == tokenizer.eos_token_id else "length" for r in response_ids]
    return Rollouts(prompt_ids, response_ids, [[0.0] * len(r) for r in response_ids], finish)


def sample_keys(rollouts: Rollouts) -> list[Key]:
    return [
        (tuple(p), tuple(r))
        for p, r in zip(rollouts.prompt_ids, rollouts.response_ids, strict=True)
    ]


# ------------------------------------------------------------------------------------------ grpo_ds


class PlainEngine:
    """What optimizer_step needs of a DeepSpeed engine, on a plain module: backward accumulates,
    step does nothing."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def step(self) -> None:
        pass


def grpo_ds_advantages(inputs: Inputs, rollouts: Rollouts) -> list[float]:
    """The trainer's rewards and advantages (grpo_ds.step.collect.score_functions,
    grpo_ds.step.advantage.advantages)."""
    G = inputs.recipe.rollout.group_size
    prompts = [inputs.prompts[i // G] for i in range(0, len(rollouts), G)]
    rewards = score_functions(inputs, prompts, rollouts, G).total
    ctx = StepContext(inputs, Dist(0, 1, 0, torch.device("cpu")))
    advantages, _ = step_advantages(ctx, StepBatch([], rollouts, rewards))
    return advantages


def grpo_ds_update(
    engine, inputs: Inputs, rollouts: Rollouts, advantages: list[float], dist: Dist
) -> tuple[float, int]:
    """grpo_ds.step.update.optimizer_step over the step's plan; returns (loss, micro-batches
    run)."""
    recipe = inputs.recipe
    data = StepBatch([], rollouts, [], advantages=advantages)
    data.plan = plan = plan_recipe_step(recipe, data.sequence_tokens(), dist.world_size, 1)
    if len(plan.minibatches) != 1 or plan.old_logprob_pass:
        raise SystemExit("check_step_vs_trl: the recipe must make one optimizer step per rollout")
    settings = UpdateSettings.from_recipe(
        recipe, inputs.tokenizer.pad_token_id, inputs.kernels_backend
    )
    stats, stepped = optimizer_step(engine, data, plan.minibatches[0], settings, dist)
    if not stepped:
        raise SystemExit("check_step_vs_trl: grpo_ds skipped the step (non-finite loss)")
    return stats.loss, len(plan.minibatches[0].micro_batches[dist.rank])


def run_grpo_ds(inputs: Inputs, rollouts: Rollouts) -> StepResult:
    """grpo_ds's step on the ZeRO-3 engine of grpo_ds.train (world size 1)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from grpo_ds.distributed.ranks import init_distributed
    from grpo_ds.model.engine import create_train_engine

    recipe = inputs.recipe
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's start-up chatter
        dist = init_distributed()
        engine = create_train_engine(
            load_model(recipe.model, len(inputs.tokenizer), recipe.run.seed), inputs.ds_config
        )
    grads: dict[str, torch.Tensor] = {}
    engine_step = engine.step

    def step_after_reading_grads():
        grads.update(
            {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
        )
        engine_step()

    engine.step = step_after_reading_grads
    advantages = grpo_ds_advantages(inputs, rollouts)
    loss, micro_batches = grpo_ds_update(engine, inputs, rollouts, advantages, dist)
    weights = {
        n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()
    }
    return StepResult(
        grads,
        weights,
        loss,
        float(engine.get_global_grad_norm()),
        dict(zip(sample_keys(rollouts), advantages, strict=True)),
        micro_batches,
        float(sum(rollouts.trained_tokens(i) for i in range(len(rollouts)))),
    )


def grpo_ds_plain_grads(
    inputs: Inputs, rollouts: Rollouts, advantages: list[float]
) -> dict[str, torch.Tensor]:
    """grpo_ds's accumulated gradient for the given advantages, on a plain module (no DeepSpeed, no
    optimizer)."""
    recipe = inputs.recipe
    model = load_model(recipe.model, len(inputs.tokenizer), recipe.run.seed)
    grpo_ds_update(
        PlainEngine(model), inputs, rollouts, advantages, Dist(0, 1, 0, torch.device("cpu"))
    )
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------- TRL


def build_trl_trainer(recipe: Recipe, inputs: Inputs, output_dir: str):
    """GRPOTrainer as bench_vs_trl_runner.run_trl builds it, for one optimizer step."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from grpo_ds.rewards.builtin import BUILTIN_REWARDS

    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": p.columns[recipe.data.prompt_key],
                "answer": p.columns[recipe.data.answer_key],
            }
            for p in inputs.prompts
        ]
    )
    config = GRPOConfig(**{**trl_config(recipe, output_dir, "cpu"), "max_steps": 1})
    model = load_model(recipe.model, len(inputs.tokenizer), recipe.run.seed)
    return GRPOTrainer(
        model=model,
        reward_funcs=[BUILTIN_REWARDS[s["name"]] for s in recipe.reward.functions],
        args=config,
        train_dataset=dataset,
        processing_class=inputs.tokenizer,
    )


def serve_fixed_completions(trainer, rollouts: Rollouts) -> None:
    """Replace TRL's sampling: the k-th copy of a prompt in the batch gets that prompt's k-th fixed
    completion."""
    by_prompt: dict[tuple[int, ...], list[list[int]]] = collections.defaultdict(list)
    for prompt, response in zip(rollouts.prompt_ids, rollouts.response_ids, strict=True):
        by_prompt[tuple(prompt)].append(response)

    def generate_single_turn(
        prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        served: collections.Counter = collections.Counter()
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            if key not in by_prompt:
                raise SystemExit(
                    f"check_step_vs_trl: TRL tokenised a prompt as {list(ids)}, which is not one "
                    "of grpo_ds's prompt token ids"
                )
            out.append(list(by_prompt[key][served[key]]))
            served[key] += 1
        return out, None  # TRL's transformers path returns no sampling log-probs either

    trainer._generate_single_turn = generate_single_turn


def run_trl(recipe: Recipe, inputs: Inputs, rollouts: Rollouts) -> StepResult:
    """One TRL optimizer step on the fixed batch: gradient read before clipping, weights after the
    step."""
    seen: dict = {"losses": [], "batches": []}
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trl_trainer(recipe, inputs, output_dir)
        serve_fixed_completions(trainer, rollouts)
        model = trainer.model
        generate_and_score, training_step, clip = (
            trainer._generate_and_score_completions,
            trainer.training_step,
            trainer._clip_grad_norm,
        )

        def scored(generation_batch):
            seen["batches"].append(generate_and_score(generation_batch))
            return seen["batches"][-1]

        def counted_training_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            seen["losses"].append(float(loss))
            return loss

        def clip_after_reading_grads(wrapped):
            seen["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            seen["grad_norm"] = float(clip(wrapped))
            return seen["grad_norm"]

        trainer._generate_and_score_completions = scored
        trainer.training_step = counted_training_step
        trainer._clip_grad_norm = clip_after_reading_grads
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints its logs
            trainer.train()
    if len(seen["batches"]) != 1 or "grads" not in seen:
        raise SystemExit(
            f"check_step_vs_trl: expected one generation and one optimizer step, got "
            f"{len(seen['batches'])} generations"
        )
    batch = seen["batches"][0]
    return StepResult(
        seen["grads"],
        {n: p.detach().clone() for n, p in model.named_parameters()},
        sum(seen["losses"]),
        seen["grad_norm"],
        trl_advantages(batch),
        len(seen["losses"]),
        float(batch["num_items_in_batch"]),
    )


def trl_advantages(batch: dict) -> dict[Key, float]:
    """{(prompt ids, completion ids): advantage} from the output of TRL's
    _generate_and_score_completions."""
    out: dict[Key, float] = {}
    rows = zip(
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["completion_ids"],
        batch["completion_mask"],
        batch["advantages"],
        strict=True,
    )
    for p, pm, c, cm, a in rows:
        key = (tuple(p[pm.bool()].tolist()), tuple(c[cm.bool()].tolist()))
        if key in out and out[key] != float(a):
            raise SystemExit(f"check_step_vs_trl: TRL gave one sample two advantages: {key}")
        out[key] = float(a)
    return out


# --------------------------------------------------------------------------------------- comparison


def group_of(name: str) -> str:
    """Parameter group: embed_tokens, layers.i.self_attn / mlp / norms, norm, lm_head."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}.norms" if parts[2].endswith("layernorm") else ".".join(parts[:3])
    return parts[0]


def grouped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat float64 tensors per parameter group, plus "all"."""
    out: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    for name, t in tensors.items():
        out[group_of(name)].append(t.double().flatten())
    out["all"] = [t.double().flatten() for t in tensors.values()]
    return {g: torch.cat(ts) for g, ts in out.items()}


def diff_stats(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float, float]:
    """(max |other - ref|, ||other - ref|| / ||ref||, least-squares scale s of other ~ s * ref)."""
    diff = other - ref
    ref_sq = float(ref @ ref)
    rel = math.sqrt(float(diff @ diff) / ref_sq) if ref_sq else math.inf
    return float(diff.abs().max()), rel, float(ref @ other) / ref_sq if ref_sq else math.nan


def table(
    ds: StepResult,
    trl: StepResult,
    same_adv: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    lr: float,
) -> tuple[str, dict[str, float]]:
    """The per-group table, and the whole model's figures (group "all")."""
    g_ds, g_trl, g_same = grouped(ds.grads), grouped(trl.grads), grouped(same_adv)
    w_ds, w_trl, w0 = grouped(ds.weights), grouped(trl.weights), grouped(start)
    header = (
        f"{'parameter group':<19} {'|grad| grpo_ds':>14} {'max abs diff':>12} {'rel diff':>9} "
        f"{'scale TRL/ds':>12} {'rel diff, same adv':>18} {'max step diff / lr':>18} {'apart':>11}"
    )
    lines = [header, "-" * len(header)]
    summary: dict[str, float] = {}
    for g in g_ds:
        max_abs, rel, scale = diff_stats(g_ds[g], g_trl[g])
        _, rel_same, _ = diff_stats(g_same[g], g_trl[g])
        step_diff = ((w_trl[g] - w0[g]) - (w_ds[g] - w0[g])).abs() / lr
        apart = f"{int((step_diff > APART).sum())}/{step_diff.numel()}"
        lines.append(
            f"{g:<19} {float(g_ds[g].norm()):>14.6g} {max_abs:>12.3g} {rel:>9.2e} {scale:>12.7f} "
            f"{rel_same:>18.2e} {float(step_diff.max()):>18.3g} {apart:>11}"
        )
        summary = {
            "rel": rel,
            "scale": scale,
            "rel_same": rel_same,
            "apart": int((step_diff > APART).sum()),
        }
    return "\n".join(lines[:-1] + ["-" * len(header), lines[-1]]), summary


def adam_first_step_error(
    result: StepResult, start: dict[str, torch.Tensor], lr: float, max_norm: float
) -> float:
    """max |step / lr - AdamW's first step| with AdamW's first step = -c g / (c |g| + eps), c the
    clip factor."""
    c = min(1.0, max_norm / (result.grad_norm + 1e-6)) if max_norm > 0 else 1.0
    worst = 0.0
    for n, g in result.grads.items():
        expected = -c * g.double() / (c * g.double().abs() + ADAM_EPS)
        worst = max(
            worst, float(((result.weights[n] - start[n]).double() / lr - expected).abs().max())
        )
    return worst


def apart_if_same_advantages(trl: StepResult, same_adv: dict[str, torch.Tensor]) -> int:
    """Weights whose AdamW first step would differ by more than APART x lr between TRL's gradient
    and grpo_ds's gradient for TRL's advantages (what is left once the advantages agree)."""

    def step(g: torch.Tensor) -> torch.Tensor:
        return -g.double() / (g.double().abs() + ADAM_EPS)

    return sum(
        int(((step(trl.grads[n]) - step(same_adv[n])).abs() > APART).sum()) for n in trl.grads
    )


def advantage_stats(ds: dict[Key, float], trl: dict[Key, float]) -> tuple[float, float, float]:
    """(max |A_TRL - A_grpo_ds|, min and max of A_TRL / A_grpo_ds over A != 0) over the batch's
    samples."""
    if set(ds) != set(trl):
        raise SystemExit("check_step_vs_trl: TRL trained other samples than grpo_ds")
    ratios = [trl[k] / ds[k] for k in ds if ds[k] != 0]
    return max(abs(trl[k] - ds[k]) for k in ds), min(ratios, default=1.0), max(ratios, default=1.0)


def verdict(summary: dict[str, float], ratio_range: tuple[float, float]) -> str:
    """One line: identical, different only through the advantages, a constant factor, or
    different."""
    if summary["rel"] < NOISE:
        return "VERDICT: identical update (the gradients agree to float32 rounding)"
    if summary["rel_same"] < NOISE:
        lo, hi = ratio_range
        return (
            "VERDICT: the same loss, normalisation and optimizer step; the only difference is the "
            "advantages: TRL divides by (group std + 1e-4), grpo_ds by (group std + 1e-6), so "
            f"TRL's advantages are {lo:.6f}..{hi:.6f} x "
            "grpo_ds's (per group, not one constant factor)"
        )
    if abs(summary["scale"] - 1) > NOISE and summary["rel"] < 10 * abs(summary["scale"] - 1):
        return (
            f"VERDICT: systematic difference: TRL's gradient is {summary['scale']:.6f} x grpo_ds's "
            "(a constant factor; Adam is nearly invariant to "
            "it, gradient clipping and Adam's eps are not)"
        )
    return (
        "VERDICT: the updates differ (relative gradient difference "
        f"{summary['rel']:.2e}), not by a constant factor"
    )


# --------------------------------------------------------------------------------------------- main


def quiet() -> None:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    for name in ("DeepSpeed", "accelerate", "trl", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


def report(
    recipe: Recipe,
    stage: int,
    rollouts: Rollouts,
    ds: StepResult,
    trl: StepResult,
    same_adv: dict[str, torch.Tensor],
    plain: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
) -> None:
    t, lr, G = recipe.train, recipe.train.lr, recipe.rollout.group_size
    keys = sample_keys(rollouts)
    mixed = sum(
        len({ds.advantages[k] for k in keys[g : g + G]}) > 1 for g in range(0, len(keys), G)
    )
    print(
        f"batch: {len(keys) // G} prompts x {G} completions ({mixed} groups with mixed rewards), "
        f"{sum(len(r) for r in rollouts.response_ids)} completion tokens, "
        f"{rollouts.finish_reason.count('length')} completions cut by the length limit; one "
        f"optimizer step of {recipe.samples_per_optimizer_step} "
        f"samples; temperature {recipe.rollout.temperature}\n"
    )
    text, summary = table(ds, trl, same_adv, start, lr)
    print(text, end="\n\n")
    adv_abs, lo, hi = advantage_stats(ds.advantages, trl.advantages)
    _, plain_rel, _ = diff_stats(grouped(ds.grads)["all"], grouped(plain)["all"])
    print(f"{'':<44}{'grpo_ds':>16}{'TRL':>16}")
    print(
        f"{'micro-batches of the optimizer step':<44}{ds.micro_batches:>16}{trl.micro_batches:>16}"
    )
    print(
        f"{'token normaliser (completion tokens)':<44}{ds.normaliser:>16.0f}{trl.normaliser:>16.0f}"
    )
    print(f"{'loss of the step (sum over micro-batches)':<44}{ds.loss:>+16.9f}{trl.loss:>+16.9f}")
    print(
        f"{'gradient norm before clipping at ' + str(t.max_grad_norm):<44}{ds.grad_norm:>16.9f}"
        f"{trl.grad_norm:>16.9f}   (ratio TRL/grpo_ds {trl.grad_norm / ds.grad_norm:.7f})"
    )
    print(
        f"{'|step / lr - AdamW first step| max':<44}"
        f"{adam_first_step_error(ds, start, lr, t.max_grad_norm):>16.2e}"
        f"{adam_first_step_error(trl, start, lr, t.max_grad_norm):>16.2e}"
    )
    print(
        f"advantages: max |A_TRL - A_grpo_ds| {adv_abs:.3g}; "
        f"A_TRL / A_grpo_ds from {lo:.6f} to {hi:.6f}"
    )
    print(
        f"weights stepping more than {APART:.0%} of lr apart: {summary['apart']} with the two "
        f"advantages, {apart_if_same_advantages(trl, same_adv)} with TRL's advantages on both "
        "sides (AdamW's first step -lr g/(|g| + eps) flips with the sign of a near-zero g)"
    )
    print(
        f"grpo_ds on DeepSpeed (ZeRO stage {stage}) vs grpo_ds on a plain module: relative "
        f"gradient difference {plain_rel:.2e}"
    )
    print(verdict(summary, (lo, hi)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny_cpu.json"))
    parser.add_argument(
        "--record", action="store_true", help="append the report to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    quiet()
    recipe = load_recipe(args.recipe)
    inputs = prepare_inputs(recipe, None, 1, "cpu")
    rollouts = fixed_rollouts(inputs)
    start = {
        n: p.detach().clone()
        for n, p in load_model(
            recipe.model, len(inputs.tokenizer), recipe.run.seed
        ).named_parameters()
    }
    trl = run_trl(recipe, inputs, rollouts)  # before DeepSpeed creates its process group
    ds = run_grpo_ds(inputs, rollouts)
    keys = sample_keys(rollouts)
    same_adv = grpo_ds_plain_grads(inputs, rollouts, [trl.advantages[k] for k in keys])
    plain = grpo_ds_plain_grads(inputs, rollouts, [ds.advantages[k] for k in keys])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report(recipe, zero_stage(inputs.ds_config), rollouts, ds, trl, same_adv, plain, start)
    common.report(
        "check_step_vs_trl",
        "one fixed batch, one optimizer step, grpo_ds vs TRL GRPOTrainer",
        "cpu",
        f"```\n{printed.getvalue().rstrip()}\n```",
        [f"recipe: {os.path.relpath(args.recipe, REPO)}"],
        args.record,
    )


if __name__ == "__main__":
    main()
