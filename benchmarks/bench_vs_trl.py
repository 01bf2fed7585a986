"""grpo_ds against TRL's GRPOTrainer: the same model, task, reward and batch, side by side on one
machine.

CPU (about 8 minutes on 2 idle cores; trl from a virtualenv, so the main environment's packages stay
as they are):

    python -m venv --system-site-packages /tmp/trlvenv && /tmp/trlvenv/bin/pip install "trl>=1.16"
    python benchmarks/bench_vs_trl.py --trl-python /tmp/trlvenv/bin/python --record
    python benchmarks/bench_vs_trl.py --trl-python /tmp/trlvenv/bin/python --shape realistic
        --record

Without --trl-python, TRL runs in this interpreter (when trl is installed here). Both trainers
follow one grpo_ds recipe, chosen by --shape (SHAPES below):

    tiny        (CPU default) recipes/tiny_cpu.json: builtin:tiny, a random 2-layer Llama with the
                character tokenizer; builtin:arith; exact_match; 25 prompts x 16 completions of at
                most 2 tokens per step; one AdamW step per rollout; 400 steps, so the reward curves
                can be compared too
    realistic   (CPU) the per-token work at a realistic vocabulary: a random Qwen2-architecture
                model (hidden 256, 4 layers) over 151,936 tokens, 8 prompts x 8 completions of
                64 tokens, micro-batches of 16, float32, 2 threads; 5 steps (the reward of a random
                model stays 0: time and memory only)
    qwen2-0.5b  (CUDA default) a random model of Qwen2.5-0.5B's shape (0.49 B parameters), bfloat16,
                16 prompts x 8 completions of 256 tokens

The Qwen2 models are built from a config in code with --seed and saved once to a temporary folder
that both load; a random model over a 151,936-token vocabulary practically never samples EOS, so
completions have a fixed length. TRL's GRPOConfig is derived from the recipe
(bench_vs_trl_runner.trl_config); the pairs are printed, and so is every setting that cannot be
matched.

Each run is a fresh process (bench_vs_trl_runner.py). The runs alternate, grpo_ds then TRL, --runs
times, so a drift of the machine's speed hits both alike; run i of both trainers uses seed --seed +
i (the same initial weights and prompt order within a pair). Per trainer:

    step s         median wall time from one step's end to the next (the first step, a warm-up, left
                   out)
    CPU s/step     median CPU time of the process (all threads) per step, likewise: less sensitive
                   than the wall time to other jobs on the machine, though contention still inflates
                   it
    samples/s      samples trained / time from the loop's start to the last step's end, over all
                   runs
    startup s      median time from starting the process to the training loop (imports, model,
                   engine)
    peak RSS MiB   largest peak resident set (VmHWM) of a run's process; on CUDA also the peak
                   allocated GPU memory
    reward @ N     mean reward of the steps that end in the last --window samples before N, mean
                   over runs
    final reward   mean reward of the last 10 steps, mean over runs

The reward verdict compares the means at every reward @ N point and at the end, and prints each
difference with its standard error (runs of one trainer are independent seeds; the two trainers draw
different random numbers, so the difference's standard error is sqrt(se_grpo_ds^2 + se_TRL^2)).

--lean adds grpo_ds in lean bf16 mode (train.lean_bf16: bf16 master weights, gradients and AdamW
moments, TRL's precision) as a third trainer, run beside the default grpo_ds and TRL in the same
alternation (--lean only: it replaces the default grpo_ds). On CUDA the issue-38 targets are
printed: grpo_ds's step time at most 0.6x TRL's, and lean grpo_ds's peak GPU memory at most TRL's.
--lean-set overrides the lean variant's recipe alone (e.g. rollout.hf_compile=off: lean without the
compiled decoding's static KV caches). On CUDA the notes say the peak GPU memory so far at the end
of each step (a peak reached in the first step, the compile's, shows there), and grpo_ds's memory
table covers step 1 too.

--reward-model (a Qwen2 shape: realistic or qwen2-0.5b; issue 36) makes a learned reward model the
only reward, weight 1: a random sequence classifier of the shape's architecture (the same hidden
size, layers, heads, MLP and RoPE; one label, pad_token_id set; a LlamaForSequenceClassification
with Qwen2's biases, see build_reward_model_folder for why not Qwen2ForSequenceClassification) with
its own tokenizer, grpo_ds.reward_models.tiny.build_reward_tokenizer (character-level, 105 tokens,
its own specials and chat template: no token has the policy's id). Its embedding keeps the policy's
151,936 rows, so it has the policy's parameter count and memory, though only the tokenizer's 105
rows are ever read. The policy's tokenizer then names every one of its 151,936 ids
(build_named_tokenizer: the 103 character tokens as without --reward-model, and a word of a space
and four letters for every other id), so that a completion of 64 random tokens decodes to about 320
characters, which the reward model's character tokenizer reads as about 320 tokens (plus the chat
template and the prompt); prompts tokenize as without it. Without --reward-model the policy keeps
the character tokenizer alone, whose 103 names leave almost every sampled id without text. It is
saved once to a temporary folder next to the policy's; grpo_ds reads it through reward.models
(chat_template true), TRL through reward_funcs (the model object) and reward_processing_classes (its
tokenizer). The table gains the reward model's share of each trainer's step time and of its peak
memory; the notes give each trainer's reward-model input length (mean and max, its tokens) and first
text, and check that TRL's completion texts are grpo_ds's decoding of the same ids
(grpo_ds.step.collect.completion_texts); the issue-36 targets are printed: grpo_ds at most 0.6x
TRL's peak memory and at most 0.8x its step time.

    python benchmarks/bench_vs_trl.py --trl-python /tmp/trlvenv/bin/python --shape realistic
        --reward-model --record

--record appends the table, the matched and unmatched settings, and the per-phase times to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    # measure this checkout's grpo_ds, whatever copy pip has installed
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from bench_vs_trl_runner import trl_config  # noqa: E402
from common import fmt, markdown_table, report, verdict  # noqa: E402

from grpo_ds.config.loading import load_recipe  # noqa: E402
from grpo_ds.config.parse import parse_override  # noqa: E402
from grpo_ds.config.recipe import Recipe  # noqa: E402
from grpo_ds.step.memory_timeline import format_table, phase_peaks  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "bench_vs_trl_runner.py"
# the pair every comparison is made between (the first grpo_ds variant run)
TRAINERS = ("grpo_ds", "trl")
LABELS = {"grpo_ds": "grpo_ds", "grpo_ds_lean": "grpo_ds lean bf16", "trl": "TRL GRPOTrainer"}
LEAN = {"train.lean_bf16": True}  # what the grpo_ds_lean variant adds to the recipe
# issue 38's targets on CUDA: step time against TRL's (the default variant), peak GPU memory against
# TRL's (lean)
TIME_TARGET, LEAN_MEMORY_TARGET = 0.6, 1.0
# issue 36's targets with a reward model (--reward-model), on any device: grpo_ds's peak memory and
# step time against TRL's
RM_MEMORY_TARGET, RM_TIME_TARGET = 0.6, 0.8
RM_NAME = "rm"  # the reward model's name in grpo_ds (its metrics: reward/rm)

# What every benchmark run turns off in the grpo_ds recipe: TRL does none of it either
# (save_strategy "no", no progress bar, no completions table).
QUIET = {
    "checkpoint.every_steps": None,
    "run.save_final_model": False,
    "logging.progress_bar": False,
    "logging.samples_every_steps": None,
    "logging.every_steps": 10**9,
    "run.overwrite": True,
}

# Random Qwen2-architecture models built from a config in code (the builtin character tokenizer
# beside them, or with --reward-model build_named_tokenizer): a
# random model over a 151,936-token vocabulary practically never samples EOS, so every completion is
# max_new_tokens long. QWEN2_05B is Qwen2.5-0.5B's shape (0.49 B parameters with tied embeddings).
QWEN2_COMMON = dict(
    vocab_size=151_936,
    max_position_embeddings=4_096,
    rope_theta=1e6,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=1,
)
QWEN2_05B = dict(
    QWEN2_COMMON,
    hidden_size=896,
    intermediate_size=4_864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)
QWEN2_CPU = dict(
    QWEN2_COMMON,
    hidden_size=256,
    intermediate_size=1_024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@dataclass(frozen=True)
class Shape:
    """What both trainers train in one mode of the benchmark."""

    about: str  # for --help
    recipe: dict | None  # an inline grpo_ds recipe; None: recipes/tiny_cpu.json
    # a Qwen2Config's arguments (saved once to a temporary folder both load); None: builtin:tiny
    model: dict | None
    dtype: torch.dtype = torch.float32
    steps: int = 0  # default --steps (0: the recipe's)
    threads: int = 1  # default torch threads per run on CPU


def qwen2_recipe(dtype: str, prompts: int, new_tokens: int, logprob_micro: int) -> dict:
    """The inline recipe of a random-Qwen2 shape: builtin:arith, exact_match, 8 completions per
    prompt, GRPO with the token-mean loss, no KL, lr 1e-6, micro-batches of 16 samples, ZeRO-3."""
    return {
        "data": {"train": "builtin:arith"},
        "model": {"dtype": dtype},
        "rollout": {
            "prompts_per_step": prompts,
            "group_size": 8,
            "max_new_tokens": new_tokens,
            "temperature": 1.0,
        },
        "reward": {"functions": [{"name": "exact_match", "weight": 1.0}]},
        "algorithm": {
            "advantage": "grpo",
            "loss_agg": "token-mean",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "kl_coef": 0.0,
        },
        "train": {
            "micro_batch_samples_per_gpu": 16,
            "logprob_micro_batch_samples_per_gpu": logprob_micro,
            "lr": 1e-6,
        },
        "deepspeed": "ds_configs/zero3.json",
    }


SHAPES = {
    "tiny": Shape(
        "recipes/tiny_cpu.json: builtin:tiny (2-layer Llama, character vocabulary of 103), 25 "
        "prompts x 32 completions of <= 2 tokens",
        None,
        None,
    ),
    "realistic": Shape(
        "a random Qwen2 (hidden 256, 4 layers) over a 151,936-token vocabulary, float32, 8 prompts "
        "x 8 completions of 64 tokens, micro-batches of 16",
        qwen2_recipe("float32", 8, 64, 16),
        QWEN2_CPU,
        steps=5,
        threads=2,
    ),
    "qwen2-0.5b": Shape(
        "a random Qwen2.5-0.5B-shaped model (0.49 B), bfloat16, "
        "16 prompts x 8 completions of 256 tokens (for CUDA)",
        qwen2_recipe("bfloat16", 16, 256, 32),
        QWEN2_05B,
        dtype=torch.bfloat16,
        steps=12,
        threads=0,
    ),
}
DEFAULT_SHAPE = {"cpu": "tiny", "cuda": "qwen2-0.5b"}

# Settings that differ between the two and cannot be made equal from the outside.
UNMATCHED = [
    "engine: grpo_ds trains a DeepSpeed engine (world size 1: one process, ZeRO stage 1 as grpo_ds "
    "runs a stage-3 file on one rank; gloo backend on CPU); TRL trains the plain torch module "
    "through accelerate. Both generate with the module they train (grpo_ds's hf engine shares the "
    "policy's module wherever every rank holds it whole)",
    "generation: both call transformers generate on left-padded prompts with the same sampling "
    "settings; TRL samples with generate's torch.multinomial, grpo_ds picks each token in its last "
    "logits processor by inverse transform sampling (the same distribution, one random number per "
    "row) and records its log-prob there, so the "
    "completions (and the reward curves) differ run by run",
    "prompt order: both shuffle the prompts with the run's seed, through different samplers",
    "micro-batches: grpo_ds's planner and TRL's shuffled split of the generation batch put "
    "different samples together; the loss of the optimizer "
    "step (a sum over its micro-batches) is the same",
    "advantage eps: (r - mean) / (std + eps) with eps 1e-6 in grpo_ds and 1e-4 in TRL (both the "
    "unbiased std); with 0/1 rewards and 16 samples per group a non-zero std is at least 0.25, so "
    "this changes advantages by less than 0.04 %",
    "optimizer: the same AdamW (betas, eps 1e-8, weight decay, constant learning rate, clipping at "
    "the same global gradient norm), applied by DeepSpeed to its flat fp32 partition (torch's "
    "fused AdamW on CPU, DeepSpeed's FusedAdam on CUDA) in grpo_ds and by torch per parameter in "
    "TRL (adamw_torch on CPU, adamw_torch_fused on CUDA)",
    "bf16 (CUDA): DeepSpeed keeps fp32 master weights and optimizer states; TRL updates the bf16 "
    "weights it loaded, under autocast",
    "bookkeeping: grpo_ds writes metrics.jsonl and a per-rank log every step; TRL logs every step "
    "(logging_steps 1) to its printer",
]


@dataclass
class Run:
    trainer: str
    index: int
    seed: int
    startup_s: float
    loop_s: float
    step_s: list[float]
    cpu_step_s: list[float]  # CPU time of the process, all threads, per step
    reward: list[float]
    response_len: list[float]
    phases: dict[str, list[float]]
    peak_rss_mib: float
    peak_gpu_mib: float | None
    # CUDA: torch.cuda.max_memory_allocated() at the end of each step (the peak so far), to tell a
    # first-step peak
    gpu_peak_by_step: list[float] | None
    versions: dict[str, str]
    threads: int
    # grpo_ds: grpo_ds.step.memory_timeline.phase_peaks of its profiled steps
    memory_peaks: list | None = None
    # TRL with a reward model: RSS (MiB) at the start, peak and rise of each scoring
    rm_memory: dict | None = None
    # with a reward model: what it read (the runner's "tokens", "completion_chars", "example";
    # grpo_ds: "truncated"; TRL: "decoded_as_grpo_ds", "decoded_differently")
    rm_inputs: dict | None = None


# ------------------------------------------------------------------------------------------ recipes


def bench_recipe(
    args: argparse.Namespace, seed: int, workdir: Path, trainer: str = "grpo_ds"
) -> Recipe:
    """The recipe both trainers follow for the run with this seed (``trainer`` grpo_ds_lean: in lean
    bf16 mode)."""
    overrides = {
        **dict(parse_override(o) for o in args.set),
        **QUIET,
        "train.steps": args.steps,
        "run.seed": seed,
        "run.output_dir": str(workdir / "runs"),
        "run.name": f"{trainer}_seed{seed}",
        **(
            {**LEAN, **dict(parse_override(o) for o in args.lean_set)}
            if trainer == "grpo_ds_lean"
            else {}
        ),
    }
    shape = SHAPES[args.shape]
    if shape.recipe is None:
        return load_recipe(REPO / "recipes" / "tiny_cpu.json", overrides)
    recipe = {**shape.recipe, "model": {**shape.recipe["model"], "path": str(workdir / "model")}}
    if args.reward_model:  # the reward model is the only reward, weight 1
        recipe["reward"] = {
            "functions": [],
            "models": [
                {
                    "path": str(workdir / "reward_model"),
                    "name": RM_NAME,
                    "weight": 1.0,
                    "chat_template": True,
                }
            ],
        }
    return load_recipe(recipe, overrides)


def build_qwen2_folder(folder: Path, shape: Shape, seed: int, named: bool = False) -> int:
    """Save the shape's random Qwen2 model and the builtin character tokenizer (``named``:
    build_named_tokenizer over the model's vocabulary, checked as both trainers load it); return the
    number of parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_ds.model.tiny import build_tiny_tokenizer

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**shape.model)).to(shape.dtype)
    model.save_pretrained(folder)
    (
        build_named_tokenizer(shape.model["vocab_size"]) if named else build_tiny_tokenizer()
    ).save_pretrained(folder)
    if named:
        check_named_tokenizer(folder, shape.model["vocab_size"])
    return sum(p.numel() for p in model.parameters())


def id_word(token_id: int) -> str:
    """build_named_tokenizer's piece for an id past the character tokens: a space and four lowercase
    letters spelling ``token_id - 103`` in base 26 (103: " aaaa", 104: " aaab", ...; 26^4 = 456,976
    words)."""
    from grpo_ds.model.tiny import CHARS, SPECIAL_TOKENS

    n, letters = token_id - len(SPECIAL_TOKENS + CHARS), []
    for _ in range(4):
        n, digit = divmod(n, 26)
        letters.append(chr(ord("a") + digit))
    return " " + "".join(reversed(letters))


def build_named_tokenizer(vocab_size: int):
    """builtin:tiny's character tokenizer (grpo_ds.model.tiny: the same 103 tokens with the same
    ids, specials and chat template) over ``vocab_size`` ids, every id past the characters named by
    id_word, so that whatever id the random policy samples decodes to visible text (about 5
    characters per token, near English text under a BPE tokenizer). Encoding produces characters
    only: the character pre-tokenizer cuts the text into single characters, and the Qwen2Tokenizer
    that transformers 5 loads from a qwen2 folder is a BPE with no merges, so it never joins
    characters into a word: prompts tokenize as with the character tokenizer (check_named_tokenizer
    checks)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_ds.model.tiny import (
        CHARS,
        IM_END,
        IM_START,
        PAD,
        SPECIAL_TOKENS,
        UNK,
        build_tiny_tokenizer,
    )

    base = build_tiny_tokenizer()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    vocab.update((id_word(i), i) for i in range(len(vocab), vocab_size))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=base.eos_token,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=base.chat_template,
        model_max_length=base.model_max_length,
    )


def check_named_tokenizer(folder: Path, vocab_size: int) -> None:
    """Load the saved tokenizer as both trainers do (grpo_ds.model.loading.load_tokenizer) and check
    that it names all ``vocab_size`` ids, decodes 4,096 seeded random ids (skipping special tokens,
    as both trainers decode completions) to their pieces, and tokenizes every builtin:arith prompt
    as the character tokenizer does."""
    import random

    from grpo_ds.config.recipe import ModelConfig
    from grpo_ds.model.loading import load_tokenizer
    from grpo_ds.model.tiny import CHARS, SPECIAL_TOKENS, build_tiny_tokenizer
    from grpo_ds.run.prompts import arith_rows

    loaded, chars = load_tokenizer(ModelConfig(path=str(folder))), build_tiny_tokenizer()
    ids = [random.Random(0).randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(4_096)]
    expected = "".join(
        CHARS[i - len(SPECIAL_TOKENS)] if i < len(SPECIAL_TOKENS + CHARS) else id_word(i)
        for i in ids
    )
    prompts = [row["prompt"] for row in arith_rows()]
    encoded = [t(prompts, add_special_tokens=False)["input_ids"] for t in (loaded, chars)]
    problems = [
        what
        for what, bad in [
            (f"it names {len(loaded)} ids, not {vocab_size}", len(loaded) != vocab_size),
            (
                "random ids decode to other text than their pieces",
                loaded.decode(ids, skip_special_tokens=True) != expected,
            ),
            (
                "builtin:arith prompts tokenize otherwise than with the character tokenizer",
                encoded[0] != encoded[1],
            ),
        ]
        if bad
    ]
    if problems:
        raise SystemExit(
            f"bench_vs_trl: the policy's named tokenizer, loaded from {folder} as "
            f"{type(loaded).__name__}: {'; '.join(problems)}"
        )


def build_reward_model_folder(folder: Path, shape: Shape, seed: int) -> int:
    """Save a random sequence classifier (one label) of the shape's Qwen2 architecture with the
    reward tokenizer of grpo_ds.reward_models.tiny (another vocabulary than the policy's, a chat
    template of its own); return its number of parameters. Seeded apart from the policy (seed +
    10,000).

    The model is a LlamaForSequenceClassification with Qwen2's dimensions, RoPE theta and q/k/v
    biases (Llama's attention_bias adds one to o_proj too: hidden_size numbers per layer), not a
    Qwen2ForSequenceClassification: transformers 5.24's AutoTokenizer loads the tokenizer of any
    folder whose config.json says qwen2 as a Qwen2Tokenizer (qwen2 is in
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), whose byte-level pre-tokenizer and NFC normaliser
    replace the character tokenizer's: its newlines vanish, so both trainers would read other texts
    than the chat template writes. The embedding keeps the policy's vocabulary size (the tokenizer
    names its first rows only), so the reward model has the policy's size."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_ds.reward_models.tiny import build_reward_tokenizer

    tokenizer, m = build_reward_tokenizer(), shape.model
    config = LlamaConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_key_value_heads"],
        max_position_embeddings=m["max_position_embeddings"],
        rope_theta=m["rope_theta"],
        rms_norm_eps=1e-6,
        attention_bias=True,
        tie_word_embeddings=False,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed + 10_000)
    model = LlamaForSequenceClassification(config).to(shape.dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def reward_model_description(shape: Shape, parameters: int) -> str:
    from grpo_ds.reward_models.tiny import build_reward_tokenizer

    m = shape.model
    return (
        "reward model: random sequence classifier of the policy's Qwen2 shape, "
        f"{parameters / 1e6:,.0f} M (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        "one label; LlamaForSequenceClassification with Qwen2's q/k/v biases plus an o_proj bias, "
        "as transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer), character tokenizer "
        f"of {len(build_reward_tokenizer())} tokens with its own chat template (embedding "
        f"of {m['vocab_size']:,} rows, as the policy's; only the first ones are named)"
    )


def model_description(shape: Shape, parameters: int, named: bool = False) -> str:
    if shape.model is None:
        return "builtin:tiny"
    m = shape.model
    return (
        f"random Qwen2 {parameters / 1e6:,.0f} M (hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, vocabulary {m['vocab_size']:,}"
        + (", every id named by its tokenizer" if named else "")
        + ")"
    )


# --------------------------------------------------------------------------------------------- runs


def check_trl(python: str) -> None:
    """Fail early, in one line, when the TRL interpreter cannot import trl (or this checkout's
    grpo_ds)."""
    probe = subprocess.run(
        [python, "-c", "import trl, grpo_ds"], env=child_env(), capture_output=True, text=True
    )
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(
            f"--trl-python {python}: cannot import trl ({last}). Install it apart from the main "
            "environment: python -m venv --system-site-packages /tmp/trlvenv && "
            "/tmp/trlvenv/bin/pip install 'trl>=1.16'; "
            "then pass --trl-python /tmp/trlvenv/bin/python"
        )


def child_env(threads: int = 0) -> dict[str, str]:
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
    )
    return env


def run_one(
    trainer: str, python: str, recipe: Recipe, index: int, args: argparse.Namespace, workdir: Path
) -> Run:
    """One training run in a fresh process; its timings relative to the moment the process was
    started."""
    tag = f"{trainer}_run{index}"
    spec, out, log = (
        workdir / f"{tag}.spec.json",
        workdir / f"{tag}.out.json",
        workdir / f"{tag}.log",
    )
    spec_recipe = recipe.to_dict()
    if trainer != "trl" and recipe.train.steps >= 2:  # its memory timeline (no torch.profiler)
        spec_recipe["logging"].update(profile_steps=list(profiled_steps(args)), profile_trace=False)
    spec.write_text(
        json.dumps(
            {
                "recipe": spec_recipe,
                "device": args.device,
                "trl_output_dir": str(workdir / "trl" / tag),
            }
        )
    )
    print(
        f"  run {index + 1}/{args.runs}: {LABELS[trainer]} (seed {recipe.run.seed}) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(
            [python, str(RUNNER), "trl" if trainer == "trl" else "grpo_ds", str(spec), str(out)],
            cwd=REPO,
            env=child_env(args.threads),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(
            f"{LABELS[trainer]} run {index + 1} failed (exit "
            f"{done.returncode}); end of {log}:\n{tail}"
        )
    result = json.loads(out.read_text())
    ends = result["step_end"]
    if len(ends) != recipe.train.steps or len(result["reward"]) != recipe.train.steps:
        raise SystemExit(
            f"{LABELS[trainer]} run {index + 1}: {len(ends)} steps timed and "
            f"{len(result['reward'])} rewards logged, expected {recipe.train.steps}; see {log}"
        )
    loop_start = result["loop_start"]
    # as each run ends, so that a benchmark cut off by a time limit still says where its time went
    print(
        f"    done in {time.monotonic() - start:.1f} s: start-up {loop_start - start:.1f} s, steps "
        + ", ".join(f"{d:.2f}" for d in deltas(loop_start, ends))
        + " s"
        + (f", peak GPU {result['peak_gpu_mib']:,.0f} MiB" if result.get("peak_gpu_mib") else ""),
        file=sys.stderr,
        flush=True,
    )
    timeline = Path(recipe.run.output_dir) / recipe.run.name / "profile" / "rank0.memory.csv"
    peaks = phase_peaks(timeline) if trainer != "trl" and timeline.is_file() else None
    if (
        recipe.reward.models
        and trainer != "trl"
        and not any(p.phase == "reward_model" for p in peaks or ())
    ):
        raise SystemExit(
            f"{LABELS[trainer]} run {index + 1}: no reward_model "
            f"phase in its memory timeline {timeline}"
        )
    return Run(
        trainer,
        index,
        recipe.run.seed,
        startup_s=loop_start - start,
        loop_s=ends[-1] - loop_start,
        step_s=deltas(loop_start, ends),
        cpu_step_s=deltas(result["cpu_loop_start"], result["cpu_step_end"]),
        reward=result["reward"],
        response_len=result["response_len"],
        phases=result["phases"],
        peak_rss_mib=result["peak_rss_mib"],
        peak_gpu_mib=result.get("peak_gpu_mib"),
        gpu_peak_by_step=result.get("gpu_peak_mib") or None,
        versions=result["versions"],
        threads=result["threads"],
        memory_peaks=peaks,
        rm_memory=result.get("reward_model_memory") or None,
        rm_inputs=result.get("reward_model_inputs") or result.get("reward_model_memory") or None,
    )


def profiled_steps(args: argparse.Namespace) -> tuple[int, int]:
    """The steps of grpo_ds's memory timeline, (first, last): from step 2 on a CPU (step 1's RSS
    rises are first-touch, not the steady step's), from step 1 on CUDA, where a peak reached in step
    1 (the compile, state built lazily) counts in max_memory_allocated and so must be found; to step
    11 at most."""
    return (1 if args.device == "cuda" else 2), min(args.steps, 11)


def deltas(start: float, ends: list[float]) -> list[float]:
    return [b - a for a, b in zip([start, *ends], ends, strict=False)]


# ---------------------------------------------------------------------------------------- reporting


def reward_at(run: Run, samples: int, samples_per_step: int, window: int) -> float | None:
    """Mean reward of the steps ending in (samples - window, samples]; None past the run's end."""
    last = samples // samples_per_step
    if last < 1 or last > len(run.reward):
        return None
    first = max(1, last - max(1, window // samples_per_step) + 1)
    return statistics.fmean(run.reward[first - 1 : last])


def final_reward(runs: list[Run]) -> float:
    return statistics.fmean(statistics.fmean(r.reward[-10:]) for r in runs)


def standard_error(values: list[float]) -> float:
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


def reward_comparison(
    runs: dict[str, list[Run]], per_step: int, points: list[int], window: int
) -> tuple[bool, str]:
    """Whether grpo_ds's mean reward is at least TRL's at every point and at the end, and the
    differences (the first grpo_ds variant run)."""
    ahead, parts = True, []
    main = next(k for k in runs if k != "trl")
    probes = [(f"@ {n:,}", lambda r, n=n: reward_at(r, n, per_step, window)) for n in points]
    for name, value in [*probes, ("final", lambda r: statistics.fmean(r.reward[-10:]))]:
        per_run = {k: [value(r) for r in runs[k]] for k in (main, "trl")}
        if any(v is None for vs in per_run.values() for v in vs):
            continue
        diff = statistics.fmean(per_run[main]) - statistics.fmean(per_run["trl"])
        se = (standard_error(per_run[main]) ** 2 + standard_error(per_run["trl"]) ** 2) ** 0.5
        ahead &= diff >= 0
        parts.append(f"{name} {diff:+.3f} +- {se:.3f}")
    return ahead, f"reward {LABELS[main]} - TRL (mean over runs +- standard error): " + ", ".join(
        parts
    )


def versions(runs: list[Run]) -> str:
    return ", ".join(f"{k} {v}" for k, v in runs[0].versions.items())


def summary_row(
    trainer: str, runs: list[Run], per_step: int, points: list[int], window: int, cuda: bool
) -> list[str]:
    steps = [x for r in runs for x in r.step_s[1:]]  # the first step of a run is a warm-up
    cpu = [x for r in runs for x in r.cpu_step_s[1:]]
    rate = per_step * sum(len(r.step_s) for r in runs) / sum(r.loop_s for r in runs)
    rewards = [[reward_at(r, n, per_step, window) for r in runs] for n in points]
    memory = fmt(max(r.peak_rss_mib for r in runs), 0)
    if cuda:
        memory += f" ({fmt(max(r.peak_gpu_mib or 0 for r in runs), 0)})"
    return [
        LABELS[trainer],
        str(len(runs)),
        fmt(statistics.median(steps), 3),
        fmt(statistics.median(cpu), 3),
        fmt(rate, 0),
        fmt(statistics.median(r.startup_s for r in runs), 1),
        memory,
        *[fmt(statistics.fmean(v), 3) if None not in v else "-" for v in rewards],
        fmt(final_reward(runs), 3),
        fmt(statistics.fmean(x for r in runs for x in r.response_len), 2),
    ]


def phase_lines(runs: dict[str, list[Run]]) -> list[str]:
    """Median seconds per step of each phase: grpo_ds's own time_*_s metrics, TRL's timed around its
    methods."""

    def med(values: list[float]) -> str:
        return fmt(statistics.median(values) * 1e3, 1) + " ms"

    lines = []
    for key in (k for k in runs if k != "trl"):
        g = runs[key]
        parts = [f"{p} {med([x for r in g for x in r.phases[p][1:]])}" for p in g[0].phases]
        lines.append(
            f"{LABELS[key]} phases (median per step, time_*_s metrics): {', '.join(parts)}"
        )
    t = runs["trl"]
    rollout = [x for r in t for x in r.phases["rollout"][1:]]
    reward = [
        b - a
        for r in t
        for a, b in zip(r.phases["rollout"][1:], r.phases["rollout_reward"][1:], strict=True)
    ]
    rest = [
        s - x for r in t for s, x in zip(r.step_s[1:], r.phases["rollout_reward"][1:], strict=True)
    ]
    lines.append(
        f"TRL phases (median per step): rollout (_generate) {med(rollout)}, reward + advantages "
        f"(rest of _generate_and_score_completions) {med(reward)}, update and the rest of the step "
        f"{med(rest)}"
    )
    return lines


def matched_lines(recipe: Recipe, trl_kwargs: dict, model: str) -> list[str]:
    """The grpo_ds recipe keys and the GRPOConfig arguments they set, for auditing."""
    r, a, t = recipe.rollout, recipe.algorithm, recipe.train
    baseline, scale = recipe.advantage_baseline_and_scale
    m = recipe.model
    if m.path == "builtin:tiny":
        model = (
            f"builtin:tiny (Llama, hidden {m.tiny_hidden_size}, {m.tiny_num_layers} layers, "
            f"{m.tiny_num_heads} heads, character tokenizer)"
        )
    pairs = [
        (
            "model / tokenizer / init",
            f"{model}, {m.dtype}, weights from "
            + ("run.seed" if m.path == "builtin:tiny" else "--seed, saved once")
            + "; the same object for both (grpo_ds.model.loading.load_model / load_tokenizer)",
        ),
        (
            "task / reward",
            f"{recipe.data.train} (the same rows), reward "
            f"{[f['name'] for f in recipe.reward.functions]}"
            + (
                f" + reward models {[m['name'] for m in recipe.reward.models]}"
                if recipe.reward.models
                else ""
            )
            + f" weights {trl_kwargs['reward_weights']} (grpo_ds.rewards.builtin functions"
            + (" and the reward models" if recipe.reward.models else "")
            + " passed to TRL as reward_funcs)",
        ),
        (
            "group size",
            f"rollout.group_size {r.group_size} = num_generations {trl_kwargs['num_generations']}",
        ),
        (
            "prompts per step",
            f"rollout.prompts_per_step {r.prompts_per_step} = generation batch "
            f"{trl_kwargs['per_device_train_batch_size'] * trl_kwargs['steps_per_generation']} "
            f"samples / {r.group_size}",
        ),
        (
            "samples per optimizer step",
            f"{recipe.samples_per_optimizer_step} = per_device_train_batch_size "
            f"{trl_kwargs['per_device_train_batch_size']} x gradient_accumulation_steps "
            f"{trl_kwargs['gradient_accumulation_steps']}",
        ),
        (
            "micro-batch",
            f"train.micro_batch_samples_per_gpu {t.micro_batch_samples_per_gpu} = "
            f"per_device_train_batch_size {trl_kwargs['per_device_train_batch_size']}",
        ),
        (
            "steps / sample budget",
            f"train.steps {t.steps} x {recipe.samples_per_step} samples = max_steps "
            f"{trl_kwargs['max_steps']} (optimizer steps; one generation each)",
        ),
        (
            "epochs per rollout",
            f"train.epochs_per_rollout {t.epochs_per_rollout} = num_iterations "
            f"{trl_kwargs['num_iterations']} (old log-probs = current: no extra pass in either)",
        ),
        (
            "completion length",
            f"rollout.max_new_tokens {r.max_new_tokens} = max_completion_length "
            f"{trl_kwargs['max_completion_length']}",
        ),
        (
            "sampling",
            f"temperature {r.temperature}, top_p {r.top_p}, top_k {r.top_k} (both; log-probs of "
            "the trained tokens at the same temperature)",
        ),
        (
            "advantage",
            f"{a.advantage}: baseline {baseline}, scale {scale} = scale_rewards "
            f"{trl_kwargs['scale_rewards']!r}",
        ),
        (
            "loss",
            f"algorithm.loss_agg {a.loss_agg!r} = loss_type {trl_kwargs['loss_type']!r}; PPO clip "
            f"{a.clip_low}/{a.clip_high} = epsilon {trl_kwargs['epsilon']}/epsilon_high "
            f"{trl_kwargs['epsilon_high']}; kl_coef {a.kl_coef} = beta {trl_kwargs['beta']}; "
            f"mask_truncated {a.mask_truncated} = mask_truncated_completions",
        ),
        (
            "optimizer",
            f"AdamW lr {t.lr}, betas {t.adam_betas}, eps 1e-8, weight_decay {t.weight_decay}, "
            f"warm-up {t.warmup_steps} then constant (lr_scheduler_type "
            f"{trl_kwargs['lr_scheduler_type']!r}), max_grad_norm {t.max_grad_norm}",
        ),
        (
            "precision / memory",
            f"{m.dtype} (bf16 {trl_kwargs['bf16']}), gradient checkpointing "
            f"{m.gradient_checkpointing}",
        ),
        (
            "reward curve",
            "grpo_ds's reward_mean and TRL's logged reward: both the mean total reward of the "
            "step's P x G samples",
        ),
    ]
    return [f"{name}: {text}" for name, text in pairs]


# --------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default=None,
        help="what both train (default: tiny on cpu, qwen2-0.5b on cuda): "
        + "; ".join(f"{name}: {shape.about}" for name, shape in SHAPES.items()),
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: tiny 400 "
        "(the recipe's), realistic 5, qwen2-0.5b 12)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="runs per trainer, alternating grpo_ds, TRL, ... (default: 5 for tiny, else 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="run i of both trainers uses seed + i")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of each run (OMP_NUM_THREADS; default on cpu: 1 for tiny, 2 for "
        "realistic; torch's own on cuda; 0: torch's own)",
    )
    parser.add_argument(
        "--trl-python",
        default=sys.executable,
        help="interpreter that has trl installed (default: this one)",
    )
    parser.add_argument(
        "--reward-at",
        default=None,
        help="sample counts to report the reward at, comma-separated (default: 1/8, 1/4, 1/2 and "
        "all of the run's samples)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=4_000,
        help="samples averaged for each reward @ N (the steps ending in the last WINDOW samples)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a key of the recipe both trainers follow (repeatable), e.g. "
        "train.micro_batch_samples_per_gpu=400",
    )
    parser.add_argument(
        "--lean",
        choices=("off", "on", "both"),
        default="off",
        help="grpo_ds in lean bf16 mode (train.lean_bf16; needs a bfloat16 shape): on replaces the "
        "default grpo_ds, both runs the two beside TRL (default: off)",
    )
    parser.add_argument(
        "--lean-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a recipe override for the lean variant alone, after --set (e.g. "
        "rollout.hf_compile=off: lean without the compiled decoding's static KV caches)",
    )
    parser.add_argument(
        "--lean-runs",
        type=int,
        default=None,
        help="with --lean both: runs of the lean variant, in the first rounds (default: --runs; 1 "
        "is enough for its peak memory)",
    )
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="a random reward model of the shape's architecture with a tokenizer of its own is the "
        "only reward (Qwen2 shapes: realistic, qwen2-0.5b; issue 36)",
    )
    parser.add_argument(
        "--record", action="store_true", help="append the results to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: no CUDA device is visible to torch here (use --device cpu)"
        )
    args.shape = args.shape or DEFAULT_SHAPE[args.device]
    shape = SHAPES[args.shape]
    args.steps = (
        args.steps or shape.steps or load_recipe(REPO / "recipes" / "tiny_cpu.json").train.steps
    )
    args.runs = args.runs or (5 if args.shape == "tiny" else 2)
    args.trainers = {
        "off": ["grpo_ds"],
        "on": ["grpo_ds_lean"],
        "both": ["grpo_ds", "grpo_ds_lean"],
    }[args.lean] + ["trl"]
    args.lean_runs = min(args.runs, args.lean_runs or args.runs)
    if args.lean_set and args.lean == "off":
        raise SystemExit(
            "--lean-set: there is no lean variant to override without --lean on or --lean both"
        )
    dtype = dict(parse_override(o) for o in args.set).get(
        "model.dtype", str(shape.dtype).removeprefix("torch.")
    )
    if args.lean != "off" and dtype != "bfloat16":
        raise SystemExit(
            f"--lean {args.lean}: lean bf16 mode needs model.dtype bfloat16 (--shape {args.shape} "
            f"trains in {dtype}); use --shape qwen2-0.5b, or --set model.dtype=bfloat16"
        )
    if args.reward_model and shape.model is None:
        raise SystemExit(
            f"--reward-model: --shape {args.shape} has no Qwen2 architecture to build the reward "
            "model from; use --shape realistic (or qwen2-0.5b)"
        )
    if args.threads is None:
        args.threads = shape.threads if args.device == "cpu" else 0
    if args.steps < 2 or args.runs < 1:
        raise SystemExit(
            "--steps must be at least 2 (the first step of a run is a warm-up, left out of the "
            "times) and --runs at least 1"
        )
    return args


def measure(args: argparse.Namespace) -> tuple[Recipe, dict[str, list[Run]], str, str, float]:
    """Every run, alternating trainers; returns the recipe (first seed), the runs, the model's name,
    the reward model's ("" without --reward-model), minutes."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        workdir = Path(tmp)
        shape = SHAPES[args.shape]
        parameters = (
            build_qwen2_folder(workdir / "model", shape, args.seed, named=args.reward_model)
            if shape.model
            else 0
        )
        model = model_description(shape, parameters, named=args.reward_model)
        rm_model = (
            reward_model_description(
                shape, build_reward_model_folder(workdir / "reward_model", shape, args.seed)
            )
            if args.reward_model
            else ""
        )
        runs: dict[str, list[Run]] = {t: [] for t in args.trainers}
        try:
            for i in range(args.runs):  # A B A B ... (A B C A B C ... with --lean both)
                for trainer in args.trainers:
                    if trainer == "grpo_ds_lean" and args.lean == "both" and i >= args.lean_runs:
                        continue
                    recipe = bench_recipe(args, args.seed + i, workdir, trainer)
                    python = args.trl_python if trainer == "trl" else sys.executable
                    runs[trainer].append(run_one(trainer, python, recipe, i, args, workdir))
        # subprocess.run has killed the run in flight; report the finished ones
        except CutOff as stop:
            if not all(runs.values()):
                raise SystemExit(
                    f"{stop}: too early to report (every trainer needs a finished run)"
                ) from None
            args.cut_off = f"{stop} during the next run: the runs that had finished are reported"
            print(f"  {args.cut_off}", file=sys.stderr, flush=True)
        recipe = bench_recipe(args, args.seed, workdir)
    return recipe, runs, model, rm_model, (time.monotonic() - began) / 60


class CutOff(Exception):
    """SIGTERM (a time limit's `timeout`, as in benchmarks/run_gpu.sh) reached the benchmark between
    or during runs."""


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise CutOff("cut off by SIGTERM")


def main() -> None:
    args = parse_args()
    check_trl(args.trl_python)
    args.cut_off = ""
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    recipe, runs, model, rm_model, minutes = measure(args)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cuda = args.device == "cuda"
    per_step = recipe.samples_per_step
    # a short run has fewer points
    points = (
        [int(p) for p in args.reward_at.split(",")]
        if args.reward_at
        else sorted({per_step * (args.steps // d) for d in (8, 4, 2, 1)} - {0})
    )
    headers = [
        "trainer",
        "runs",
        "step s (median)",
        "CPU s/step",
        "samples/s",
        "startup s",
        "peak RSS MiB" + (" (GPU)" if cuda else ""),
        *[f"reward @ {n:,}" for n in points],
        "final reward",
        "completion tokens",
    ]
    rows = [summary_row(t, runs[t], per_step, points, args.window, cuda) for t in args.trainers]
    if args.reward_model:
        headers += [
            "reward model ms/step (share of step)",
            "reward model RSS rise MiB (share of peak RSS)",
        ]
        for row, trainer in zip(rows, args.trainers, strict=True):
            row += reward_model_cells(runs[trainer])

    main_key = args.trainers[0]
    g, t = runs[main_key], runs["trl"]

    def step_s(rs: list[Run]) -> float:
        return statistics.median(x for r in rs for x in r.step_s[1:])

    def peak(rs: list[Run]) -> float:
        return max((r.peak_gpu_mib if cuda else r.peak_rss_mib) or 0 for r in rs)

    g_step, t_step = step_s(g), step_s(t)
    g_mem, t_mem = peak(g), peak(t)
    t_final = final_reward(t)
    reward_ahead, reward_line = reward_comparison(runs, per_step, points, args.window)
    variants = [k for k in args.trainers if k != "trl"]
    ratios = [
        f"{LABELS[k]} / TRL: step time {step_s(runs[k]) / t_step:.2f}x, peak memory "
        f"{peak(runs[k]) / t_mem:.2f}x, final reward {final_reward(runs[k]):.3f} vs {t_final:.3f}"
        for k in variants
    ]
    targets = []
    if cuda:  # issue 38's targets, on the machine and commit in this block's header
        if "grpo_ds" in runs:
            ratio = step_s(runs["grpo_ds"]) / t_step
            counts = "/".join(str(len(runs[k])) for k in ("grpo_ds", "trl"))
            targets.append(
                f"target (issue 38): grpo_ds step time <= {TIME_TARGET}x TRL's (median of {counts} "
                f"runs): {ratio:.2f}x, {verdict(ratio <= TIME_TARGET)}"
            )
        if "grpo_ds_lean" in runs:
            ratio = peak(runs["grpo_ds_lean"]) / t_mem
            with_set = f" (with {' '.join(args.lean_set)})" if args.lean_set else ""
            targets.append(
                f"target (issue 38): grpo_ds lean bf16{with_set} peak GPU memory <= TRL's: "
                f"{ratio:.2f}x ({fmt(peak(runs['grpo_ds_lean']), 0)} vs {fmt(t_mem, 0)} MiB), "
                f"{verdict(ratio <= LEAN_MEMORY_TARGET)}"
            )
    if args.reward_model:  # issue 36's targets, on any device
        for key in variants:
            mem_ratio, time_ratio = peak(runs[key]) / t_mem, step_s(runs[key]) / t_step
            # one "target (...): a met, b NOT met" list, as docs/generate.py reads verdicts (no ", "
            # or "; " in an item)
            targets.append(
                f"target (issue 36, reward model): {LABELS[key]} peak memory {mem_ratio:.2f}x "
                f"TRL's (at most {RM_MEMORY_TARGET}x: {fmt(peak(runs[key]), 0)} vs {fmt(t_mem, 0)} "
                f"MiB) {verdict(mem_ratio <= RM_MEMORY_TARGET)}, {LABELS[key]} step time "
                f"{time_ratio:.2f}x TRL's (at most {RM_TIME_TARGET}x: {fmt(step_s(runs[key]), 3)} "
                f"vs {fmt(t_step, 3)} s) {verdict(time_ratio <= RM_TIME_TARGET)}"
            )
    notes = [
        "grpo_ds: DeepSpeed at world size 1 (one process, as `python -m grpo_ds.train`: ZeRO stage "
        "1 from ds_configs/zero3.json, its fp32 master "
        + (
            "the float32 weights themselves"
            if recipe.model.dtype == "float32"
            else f"a copy of the {recipe.model.dtype} weights"
        )
        + f"), on {args.device}; "
        "TRL: GRPOTrainer, plain torch through accelerate, one process",
        *(
            [
                "grpo_ds lean bf16: the same with train.lean_bf16 true (DeepSpeed's "
                "bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states: "
                "bf16 master weights, gradients and AdamW moments, TRL's precision)"
            ]
            if "grpo_ds_lean" in runs
            else []
        ),
        f"torch threads per run: {g[0].threads} (grpo_ds), {t[0].threads} (TRL)"
        + (
            " (OMP_NUM_THREADS=1: on a CPU shared with other jobs, two threads' spinning barriers "
            "inflate step times up to 30x whenever another process runs)"
            if args.threads == 1
            else ""
        ),
        *([args.cut_off] if args.cut_off else []),
        f"runs alternate {', '.join(LABELS[k] for k in args.trainers)} ({args.runs} each"
        + (
            f", lean {args.lean_runs} (the first)"
            if args.lean == "both" and args.lean_runs < args.runs
            else ""
        )
        + f"; run i seeded {args.seed} + i for all), each in a "
        f"fresh process; whole benchmark {minutes:.1f} min",
        *([f"recipe overrides (--set, both trainers): {', '.join(args.set)}"] if args.set else []),
        *(
            [
                "recipe overrides of grpo_ds lean bf16 alone "
                f"(--lean-set): {', '.join(args.lean_set)}"
            ]
            if args.lean_set and "grpo_ds_lean" in runs
            else []
        ),
        *gpu_peak_notes(runs),
        "step s: median over the runs' steps after the first; reward @ N: mean over runs of the "
        f"mean reward of the steps ending in the last {args.window:,} "
        "samples before N; final reward: the last 10 steps",
        f"versions: grpo_ds side: {versions(g)}; TRL side ({args.trl_python}): {versions(t)}",
        "final reward per run (seed order): "
        + "; ".join(
            f"{LABELS[k]} " + ", ".join(f"{final_reward([r]):.3f}" for r in runs[k])
            for k in args.trainers
        ),
        *ratios,
        f"target ({LABELS[main_key]} ahead): time per step {verdict(g_step < t_step)}, memory "
        f"{verdict(g_mem < t_mem)}, reward at equal samples "
        f"(every point and final) {verdict(reward_ahead)}",
        *targets,
        reward_line,
        *phase_lines(runs),
        *(reward_model_notes(runs, rm_model) if args.reward_model else []),
        *[
            f"matched: {line}"
            for line in matched_lines(recipe, trl_config(recipe, "-", args.device), model)
        ],
        *([f"matched: {line}" for line in RM_MATCHED] if args.reward_model else []),
        *([f"not matched: {line}" for line in RM_UNMATCHED] if args.reward_model else []),
        *([f"not matched: {rm_advantage_eps_line(t)}"] if args.reward_model else []),
        *[
            f"not matched: {line}"
            for line in UNMATCHED
            if not (line.startswith("bf16") and args.lean == "on")
            and not (line.startswith("advantage eps") and args.reward_model)
        ],
        *(
            [
                "not matched, except by grpo_ds lean bf16: bf16 (CUDA) above; lean keeps bf16 "
                "master weights and AdamW moments as TRL does, in DeepSpeed's flat partition"
            ]
            if args.lean == "both"
            else []
        ),
    ]
    r = recipe.rollout
    with_rm = (
        (
            f"with a reward model (a sequence classifier of the same shape, its own tokenizer of "
            f"{rm_model.split('character tokenizer of ')[1].split(' ')[0]} tokens), "
        )
        if rm_model
        else ""
    )
    shape = (
        f"{model}, {with_rm}{recipe.data.train}, {r.prompts_per_step} "
        f"prompts x {r.group_size} completions of <= "
        f"{r.max_new_tokens} tokens, {args.steps} steps ({per_step * args.steps:,} samples) per "
        f"run, {args.device}"
    )
    report(
        "bench_vs_trl",
        shape,
        args.device,
        markdown_table(headers, rows)
        + "".join(memory_block(runs[k], LABELS[k], profiled_steps(args)) for k in variants),
        notes,
        args.record,
    )


# With --reward-model: how each trainer feeds the reward model.
RM_MATCHED = [
    "reward model: the same saved folder (weights and tokenizer, both loaded with transformers' "
    "Auto classes) for both, in the policy's dtype, weight 1.0, "
    "the only reward; grpo_ds: reward.models [{path, name 'rm', chat_template true}] "
    "(grpo_ds.reward_models: loaded on the rank like the reference model, no optimizer); TRL: "
    "reward_funcs [the model object, AutoModelForSequenceClassification num_labels 1, as TRL loads "
    "a path] and reward_processing_classes [its tokenizer]",
    "reward model input: both decode the completion with the policy's tokenizer and render the "
    "plain-text prompt and the completion as [user: prompt, assistant: completion] with the reward "
    "model's own chat template, then tokenize that text with the reward model's tokenizer (no "
    "special tokens added: the template writes <s>); no policy token id reaches it. TRL applies a "
    "reward model's chat template only to conversational prompts, so the runner hands TRL's "
    "_calculate_rewards the prompt and completion as those two messages (the "
    "benchmark's prompts are plain text for both policies); the rest is TRL's own code",
    "reward model output: the logit of the one label at the last token of each text, unnormalised "
    "(grpo_ds mean 0, std 1)",
]
RM_UNMATCHED = [
    "reward model batching: grpo_ds packs the step's texts into token micro-batches (the planner's "
    "budget, train.logprob_micro_batch_samples_per_gpu x the longest prompt + response) with "
    "position ids restarting per text, where the model scores packed texts as alone (checked at "
    "load); TRL right-pads the whole batch of P x G "
    "texts and runs one forward, under inference_mode",
    "reward model time: grpo_ds's time_reward_model_s covers rendering, tokenizing, scoring and "
    "gathering (its 'reward_model' phase); TRL's is the wall "
    "time of _calculate_rewards (the same work, one batch)",
    "reward model memory: grpo_ds's rise is its memory timeline's reward_model phase (steps 2 on, "
    "RSS sampled every 10 ms and at the phase's bounds), the run with the highest peak; TRL's is "
    "sampled by a thread in the runner every 5 ms (and at the start and end) "
    "around _calculate_rewards, the largest rise of steps 2 on; both RSS",
    "reward model texts: the two trainers sample different ids (see generation), so their texts "
    "differ, though alike: the policy's tokenizer names every id (a character, or a space and four "
    "letters), so each 64-token completion decodes to about 320 characters and the reward model "
    "reads a few hundred of its tokens (the means are in the notes above); its "
    "vocabulary of 105 tokens means the embedding's 151,936 rows are mostly never read",
]


def rm_advantage_eps_line(trl_runs: list[Run]) -> str:
    """UNMATCHED's advantage eps line for a reward model's scores (not 0/1): its effect from the
    smallest std of a group's scores that TRL's runs met."""
    stds = [x for r in trl_runs for x in (r.rm_memory or {}).get("group_std_min", [])]
    smallest = (
        (
            "the smallest std of a group's reward-model scores in TRL's steps was "
            f"{min(stds):.4g}, so this changes advantages by at most {1e-4 / min(stds):.2%}"
        )
        if stds and min(stds) > 0
        else "TRL's runs recorded no group's std of the scores"
    )
    return (
        "advantage eps: (r - mean) / (std + eps) with eps 1e-6 in grpo_ds and 1e-4 in TRL (both "
        f"the unbiased std); the reward model's scores are not 0/1: {smallest}"
    )


def reward_model_cells(runs: list[Run]) -> list[str]:
    """The reward model's median time per step (share of the median step) and its largest RSS rise
    (share of the peak RSS), steps 2 on."""
    seconds = statistics.median(x for r in runs for x in r.phases["reward_model"][1:])
    step = statistics.median(x for r in runs for x in r.step_s[1:])
    rise, peak = reward_model_rise(runs)
    return [
        f"{fmt(seconds * 1e3, 1)} ({seconds / step:.0%})",
        f"{fmt(rise, 0)} ({rise / peak:.0%})",
    ]


def reward_model_rise(runs: list[Run]) -> tuple[float, float]:
    """(the reward model's largest RSS rise, MiB, and the peak RSS of that run): grpo_ds from its
    memory timeline's reward_model phase, TRL from the runner's samples around
    _calculate_rewards."""
    found = []
    for r in runs:
        if r.memory_peaks:
            phase = next(p for p in r.memory_peaks if p.phase == "reward_model")
            found.append((phase.rss_rise / 2**20, r.peak_rss_mib))
        elif r.rm_memory:
            rises = r.rm_memory["rise_mib"][1:] or r.rm_memory["rise_mib"]
            found.append((max(rises), r.peak_rss_mib))
    return max(found)


def reward_model_notes(runs: dict[str, list[Run]], rm_model: str) -> list[str]:
    notes = [rm_model]
    for key, rs in runs.items():  # what each trainer's reward model read, all steps of all runs
        seen = [r.rm_inputs for r in rs if r.rm_inputs and r.rm_inputs.get("tokens")]
        if not seen:
            continue
        tokens = [x for d in seen for x in d["tokens"]]
        chars = [x for d in seen for x in d.get("completion_chars", [])]
        example = next((d["example"] for d in seen if d.get("example")), "")
        cut = (
            f" ({sum(d['truncated'] for d in seen)} truncated to its max_length)"
            if "truncated" in seen[0]
            else ""
        )
        notes.append(
            f"reward model input ({LABELS[key]}'s texts, the reward model's tokenizer): "
            f"{statistics.fmean(tokens):.1f} tokens per sample on average, {max(tokens)} at "
            f"most{cut}, over {len(tokens):,} samples; completions {statistics.fmean(chars):.1f} "
            f"characters on average; the first text ({len(example)} "
            f"characters): `{json.dumps(example[:160])[1:-1]}...`"
        )
        if "decoded_as_grpo_ds" in seen[0]:
            same, other = (
                sum(d[k] for d in seen) for k in ("decoded_as_grpo_ds", "decoded_differently")
            )
            notes.append(
                f"{LABELS[key]}'s completion texts (its batch_decode of the completion ids, "
                "special tokens skipped) are grpo_ds's decoding of the same ids "
                f"(grpo_ds.step.collect.completion_texts) for {same:,} of {same + other:,} samples"
            )
    for key, rs in runs.items():
        rise, peak = reward_model_rise(rs)
        seconds = statistics.median(x for r in rs for x in r.phases["reward_model"][1:])
        notes.append(
            f"{LABELS[key]} reward model: {fmt(seconds * 1e3, 1)} ms per step (median, steps 2 "
            f"on), RSS rise {fmt(rise, 0)} MiB over a peak of {fmt(peak, 0)} MiB"
        )
    return notes


def gpu_peak_notes(runs: dict[str, list[Run]]) -> list[str]:
    """CUDA: where in a run its peak GPU memory was reached (a first step's compile or lazily built
    state, or the steady steps), from each trainer's first run."""
    by_step = {key: rs[0].gpu_peak_by_step for key, rs in runs.items() if rs[0].gpu_peak_by_step}
    if not by_step:
        return []
    return [
        "peak GPU memory so far at the end of each step "
        "(torch.cuda.max_memory_allocated, MiB, first run of each): "
        + "; ".join(
            f"{LABELS[key]} " + ", ".join(fmt(x, 0) for x in peaks)
            for key, peaks in by_step.items()
        )
    ]


def memory_block(runs: list[Run], label: str, steps: tuple[int, int]) -> str:
    """grpo_ds's memory per phase (its timeline, grpo_ds.step.memory_timeline) in the run with the
    highest peak."""
    timed = [r for r in runs if r.memory_peaks]
    if not timed:
        return ""
    worst = max(timed, key=lambda r: max(p.peak_rss for p in r.memory_peaks))
    first, last = steps
    return (
        f"\n\n{label} memory per phase, run {worst.index + 1} (seed {worst.seed}), steps "
        f"{first}-{last}: RSS from its timeline (logging.profile_steps with logging.profile_trace "
        "false, sampled every 10 ms and at every phase boundary); rise: the "
        "peak above the RSS at the start of the phase run that reached it\n\n"
        + format_table(worst.memory_peaks)
    )


if __name__ == "__main__":
    main()
