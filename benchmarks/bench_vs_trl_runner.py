"""One training run for benchmarks/bench_vs_trl.py, in its own process: grpo_ds or TRL's
GRPOTrainer.

    python benchmarks/bench_vs_trl_runner.py {grpo_ds,trl} SPEC.json OUT.json

SPEC.json holds the resolved grpo_ds recipe (``Recipe.to_dict()``) that both trainers follow; TRL's
side maps it onto a ``GRPOConfig`` in ``trl_config`` below (the one place the mapping lives;
bench_vs_trl.py prints it). OUT.json gets per-step rewards and time stamps (``time.monotonic()``, a
system-wide clock on Linux, so the parent can relate them to the moment it started this process),
per-phase times, the peak resident memory (VmHWM) and the library versions of this interpreter; with
reward models also what they read (each input's length in their tokens, each completion's in
characters, the first text) and, on TRL's side, whether its completion texts are grpo_ds's decoding
of the same ids and the smallest std of a group's scores. The TRL run may use another interpreter
than grpo_ds's (a virtualenv with trl); it imports grpo_ds only for the model, tokenizer, data and
reward code, so both train the same model.

Stamps are taken at the same point of both loops: ``loop_start`` once the trainer is built (grpo_ds:
the metrics logger is created after the DeepSpeed engine; TRL: ``on_train_begin``, after the
optimizer and accelerate's prepare), ``step_end`` after each step's optimizer step (grpo_ds: when
the step's metrics are logged, after the weight sync; TRL: ``on_step_end``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_ds.config.recipe import Recipe

TRAINERS = ("grpo_ds", "trl")
# grpo_ds's algorithm.loss_agg -> TRL's loss_type with the same normalisation of the per-token
# losses
LOSS_TYPES = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


def versions(names: tuple[str, ...]) -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        # kB -> MiB
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def new_stamps() -> dict:
    return {
        "loop_start": None,
        "cpu_loop_start": None,
        "step_end": [],
        "cpu_step_end": [],
        "gpu_peak_mib": [],
    }


def stamp(stamps: dict, key: str) -> None:
    """Wall clock (time.monotonic) and this process's CPU time, all threads (time.process_time), at
    ``key``."""
    wall, cpu = time.monotonic(), time.process_time()
    if key == "loop_start":
        stamps["loop_start"], stamps["cpu_loop_start"] = wall, cpu
    else:
        stamps[key].append(wall)
        stamps["cpu_" + key].append(cpu)
        # imported by the trainer by now; a CUDA run: the peak so far, per step
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stamps["gpu_peak_mib"].append(torch.cuda.max_memory_allocated() / 2**20)


# ------------------------------------------------------------------------------------------ grpo_ds


def run_grpo_ds(recipe: dict) -> dict:
    """grpo_ds.train on the recipe, in this process (world size 1: one DeepSpeed rank, ZeRO stage 1
    from a stage-3 file)."""
    driver = importlib.import_module("grpo_ds.train")
    stamps = new_stamps()

    class StampedLogger(driver.MetricsLogger):  # the driver builds its logger right before the loop
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            stamp(stamps, "loop_start")

        def log(self, metrics: dict) -> None:
            stamp(stamps, "step_end")
            super().log(metrics)

    driver.MetricsLogger = StampedLogger
    rm_inputs = watch_reward_model_inputs() if recipe["reward"]["models"] else {}
    history = driver.run(recipe)
    phases = [
        p
        for p in ("rollout", "reward_model", "reward", "logprob", "update", "sync")
        if f"time_{p}_s" in history[0]
    ]  # reward_model: with reward.models only
    return {
        **stamps,
        "reward": [m["reward_mean"] for m in history],
        "response_len": [m["response_len_mean"] for m in history],
        "phases": {p: [m[f"time_{p}_s"] for m in history] for p in phases},
        "reward_model_inputs": rm_inputs,
        "versions": versions(("torch", "transformers", "deepspeed", "grpo_ds")),
    }


def watch_reward_model_inputs() -> dict:
    """Record what grpo_ds's reward models read, by wrapping the scorer's ``render``: each
    completion's length in characters, each rendered input's length in the reward model's tokens
    (after any max_length cap), how many were truncated, and the first text (the chat template's
    rendering). Returns the dict it fills."""
    from grpo_ds.reward_models import scorer
    from grpo_ds.reward_models.render import render_texts

    seen: dict = {"tokens": [], "completion_chars": [], "truncated": 0}
    render = scorer.render

    def recorded(spec, tokenizer, prompts, completions, *args, **kwargs):
        ids, truncated = render(spec, tokenizer, prompts, completions, *args, **kwargs)
        if prompts and "example" not in seen:
            seen["example"] = render_texts(spec, tokenizer, prompts[:1], completions[:1])[0]
        seen["tokens"].extend(len(x) for x in ids)
        seen["completion_chars"].extend(len(c) for c in completions)
        seen["truncated"] += truncated
        return ids, truncated

    scorer.render = recorded
    return seen


# ---------------------------------------------------------------------------------------------- TRL


def trl_config(recipe: Recipe, output_dir: str, device: str) -> dict:
    """GRPOConfig keyword arguments that reproduce the grpo_ds recipe (a
    grpo_ds.config.recipe.Recipe)."""
    r, a, t = recipe.rollout, recipe.algorithm, recipe.train
    micro, per_step, per_optimizer_step = (
        t.micro_batch_samples_per_gpu,
        recipe.samples_per_step,
        recipe.samples_per_optimizer_step,
    )
    problems = []
    if per_optimizer_step % micro or per_step % per_optimizer_step:
        problems.append("train.micro_batch_samples_per_gpu must divide samples_per_optimizer_step")
    if a.loss_agg not in LOSS_TYPES:
        problems.append(f"algorithm.loss_agg {a.loss_agg!r} has no TRL loss_type")
    baseline, scale = recipe.advantage_baseline_and_scale
    if (
        baseline != "group_mean"
        or a.policy_loss != "ppo_clip"
        or a.dynamic_sampling
        or a.kl_in_reward
        or a.overlong_buffer_tokens is not None
        or a.dual_clip is not None
        or a.rollout_is_cap is not None
    ):
        problems.append("only GRPO / Dr. GRPO with the PPO-clip loss maps onto TRL here")
    if a.kl_coef > 0 and a.kl_estimator != "k3":
        problems.append("TRL's KL penalty is the k3 estimator")
    if a.entropy_coef > 0:
        problems.append(
            "the entropy bonuses are normalised differently (set algorithm.entropy_coef to 0)"
        )
    if (
        a.loss_agg == "seq-mean-token-sum-norm"
        and recipe.loss_agg_norm_tokens != recipe.max_response_tokens
    ):
        problems.append(
            "TRL's dr_grpo divides by max_completion_length, not algorithm.loss_agg_norm_tokens"
        )
    if problems:
        raise SystemExit(
            "bench_vs_trl: the recipe cannot be matched in TRL: " + "; ".join(problems)
        )
    dtype = recipe.model.dtype
    return dict(
        output_dir=output_dir,
        use_cpu=device == "cpu",
        seed=recipe.run.seed,
        data_seed=recipe.run.seed,
        # batch: one generation of P x G samples per rollout, split into micro-batches of `micro`
        # samples
        num_generations=r.group_size,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_optimizer_step // micro,
        steps_per_generation=per_step // micro,
        num_iterations=t.epochs_per_rollout,
        max_steps=t.steps * recipe.optimizer_steps_per_rollout,
        shuffle_dataset=recipe.data.shuffle,
        # generation
        max_completion_length=recipe.max_response_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        # algorithm
        beta=a.kl_coef,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type=LOSS_TYPES[a.loss_agg],
        scale_rewards=scale,
        mask_truncated_completions=a.mask_truncated,
        reward_weights=[float(spec.get("weight", 1.0)) for spec in recipe.reward.functions]
        # reward_funcs: functions, then models
        + [float(spec.get("weight", 1.0)) for spec in recipe.reward.models],
        # optimizer: AdamW, constant learning rate after warm-up, global gradient-norm clipping
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1],
        adam_epsilon=1e-8,
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
        lr_scheduler_type="constant_with_warmup" if t.warmup_steps else "constant",
        warmup_steps=t.warmup_steps,
        max_grad_norm=t.max_grad_norm,
        # precision and memory
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        gradient_checkpointing=recipe.model.gradient_checkpointing,
        # bookkeeping: every step's metrics, nothing saved, no bars, no hub
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        # kB -> MiB
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class RssSampler:
    """The highest resident memory (VmRSS) of this process while the block runs, sampled every 5 ms
    by a thread, and at its start and end; ``rise``: that peak above the RSS at its start (what the
    block added on top)."""

    def __init__(self) -> None:
        import threading

        self._stop, self._thread = (
            threading.Event(),
            threading.Thread(target=self._sample, daemon=True),
        )
        self.start = self.peak = 0.0

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib())

    def __enter__(self) -> RssSampler:
        self.start = self.peak = rss_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())

    @property
    def rise(self) -> float:
        return self.peak - self.start


def trl_reward_models(recipe: Recipe) -> tuple[list, list]:
    """Each of the recipe's reward models (reward.models) as TRL takes it: the model object (loaded
    as TRL loads a reward_funcs path, AutoModelForSequenceClassification with num_labels 1, in the
    policy's dtype as grpo_ds loads it) and its own tokenizer (reward_processing_classes)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    models, tokenizers = [], []
    for spec in recipe.reward.models:
        dtype = getattr(torch, recipe.model.dtype)
        models.append(
            AutoModelForSequenceClassification.from_pretrained(
                spec["path"], num_labels=1, dtype=dtype
            )
        )
        tokenizers.append(AutoTokenizer.from_pretrained(spec["path"]))
    return models, tokenizers


def run_trl(recipe: dict, output_dir: str, device: str) -> dict:
    """TRL's GRPOTrainer on the same model, tokenizer, prompts and reward functions (and reward
    models) as grpo_ds."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_ds.config.loading import load_recipe
    from grpo_ds.model.loading import load_model, load_tokenizer
    from grpo_ds.rewards.builtin import BUILTIN_REWARDS
    from grpo_ds.run.prompts import load_rows
    from grpo_ds.step.collect import completion_texts

    recipe = load_recipe(recipe)
    specs = recipe.reward.functions
    unknown = [s["name"] for s in specs if s["name"] not in BUILTIN_REWARDS]
    if unknown:
        raise SystemExit(
            f"bench_vs_trl: only built-in reward functions are passed to TRL, not {unknown}"
        )
    tokenizer = load_tokenizer(recipe.model)
    # the same weights grpo_ds starts from
    model = load_model(recipe.model, len(tokenizer), recipe.run.seed)
    rows = load_rows(recipe.data, recipe.source_dir)
    dataset = datasets.Dataset.from_list(
        [
            {"prompt": row[recipe.data.prompt_key], "answer": row[recipe.data.answer_key]}
            for row in rows
        ]
    )

    stamps = new_stamps()

    class Stamps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamp(stamps, "loop_start")

        def on_step_end(self, args, state, control, **kwargs):
            stamp(stamps, "step_end")

    config = GRPOConfig(**trl_config(recipe, output_dir, device))
    reward_models, reward_tokenizers = trl_reward_models(recipe)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[BUILTIN_REWARDS[s["name"]] for s in specs] + reward_models,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Stamps()],
        reward_processing_classes=[None] * len(specs) + reward_tokenizers
        if reward_models
        else None,
    )

    # phase times: generation (transformers generate), and generation + reward + advantages (TRL's
    # _generate_and_score_completions); the rest of a step is the policy update
    phases: dict[str, list[float]] = {"rollout": [], "rollout_reward": []}

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            phases[name].append(time.perf_counter() - t)
            return out

        return wrapper

    trainer._generate = timed("rollout", trainer._generate)
    trainer._generate_and_score_completions = timed(
        "rollout_reward", trainer._generate_and_score_completions
    )
    memory: dict[str, list[float]] = {}
    if reward_models:
        phases["reward_model"], memory = (
            [],
            {
                "rise_mib": [],
                "start_mib": [],
                "peak_mib": [],
                "tokens": [],
                "completion_chars": [],
                "decoded_as_grpo_ds": 0,
                "decoded_differently": 0,
                "group_std_min": [],
            },
        )
        templated = all(spec.get("chat_template", True) for spec in recipe.reward.models)
        if not templated and any(spec.get("chat_template", True) for spec in recipe.reward.models):
            raise SystemExit(
                "bench_vs_trl: TRL applies a chat template to every reward model or to none"
            )
        if templated and specs:  # the functions would get the messages too
            raise SystemExit(
                "bench_vs_trl: a chat-templated reward model "
                "is compared with no reward function beside"
            )
        calculate = trainer._calculate_rewards

        def calculate_rewards(inputs, prompts, completions, completion_ids_list):
            """TRL's own reward computation (its tokenization and one forward of the whole batch per
            model), timed, its RSS sampled; with chat templates the plain-text prompt and completion
            are handed to it as a user and an assistant message, as grpo_ds renders them: TRL
            applies a reward model's chat template only to conversational prompts. Also counts the
            completions whose text differs from what grpo_ds's own decoding
            (grpo_ds.step.collect.completion_texts) makes of the same ids."""
            ours = completion_texts(
                SimpleNamespace(tokenizer=tokenizer),
                SimpleNamespace(response_ids=[list(ids) for ids in completion_ids_list]),
            )
            same = sum(a == b for a, b in zip(ours, completions, strict=True))
            memory["decoded_as_grpo_ds"] += same
            memory["decoded_differently"] += len(ours) - same
            memory["completion_chars"].extend(len(c) for c in completions)
            if templated:
                prompts = [[{"role": "user", "content": p}] for p in prompts]
                completions = [[{"role": "assistant", "content": c}] for c in completions]
                texts = [
                    reward_tokenizers[0].apply_chat_template(p + c, tokenize=False)
                    for p, c in zip(prompts, completions, strict=True)
                ]
                memory.setdefault("example", texts[0])
                memory["tokens"].extend(
                    len(ids)
                    for ids in reward_tokenizers[0](texts, add_special_tokens=False)["input_ids"]
                )
            start = time.perf_counter()
            with RssSampler() as rss:
                out = calculate(inputs, prompts, completions, completion_ids_list)
            phases["reward_model"].append(time.perf_counter() - start)
            memory["rise_mib"].append(rss.rise)
            memory["start_mib"].append(rss.start)
            memory["peak_mib"].append(rss.peak)
            scores = out[:, len(specs) :].float().cpu()  # (P*G, models): the reward models' columns
            # unbiased, as both trainers' advantages
            memory["group_std_min"].append(
                float(scores.view(-1, recipe.rollout.group_size, scores.shape[1]).std(dim=1).min())
            )
            return out

        trainer._calculate_rewards = calculate_rewards
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e]
    return {
        **stamps,
        "reward": [e["reward"] for e in logs],
        "response_len": [e.get("completions/mean_length") for e in logs],
        "phases": phases,
        "reward_model_memory": memory,
        "versions": versions(("torch", "transformers", "trl", "accelerate", "datasets")),
    }


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in TRAINERS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(TRAINERS)}}} SPEC.json OUT.json")
    trainer, spec_path, out_path = sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    if trainer == "grpo_ds":
        result = run_grpo_ds(spec["recipe"])
    else:
        result = run_trl(spec["recipe"], spec["trl_output_dir"], spec["device"])
    import torch

    result["peak_rss_mib"], result["threads"] = peak_rss_mib(), torch.get_num_threads()
    if spec["device"] == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
