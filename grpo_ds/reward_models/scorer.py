"""Learned reward models scored on every rank, like the reference model: partitioned under ZeRO-3,
no optimizer.

One step, per reward model (every rank runs the same code):

    rank r's contiguous share of the samples (Dist.dp_slice: by data-parallel rank)
      -> rendered as text and tokenized by the model's own tokenizer (grpo_ds.reward_models.render)
      -> token micro-batches (grpo_ds.model.batching.pack_micro_batches, budget ``micro_tokens``):
         one packed row with position ids restarting per sequence where the model allows it, else
         right-padded rows with a mask
      -> the forward of the whole model; the score head's output is read at each sequence's last
         token
      -> every rank's scores all-gathered, so each rank holds the whole batch's

    score = (logit - mean) / std        (the spec's affine normalisation)

Under ZeRO-3 a forward gathers each layer's weights collectively, so every rank runs as many
forwards as the busiest rank: the others run dummy one-token micro-batches (as the log-prob pass
does with its padding micro-batches). A rendering error (``overflow: "error"``) is gathered first
and raised on every rank, before any forward, so no rank is left waiting in one.

Why the head is read through a forward hook: a ``ForSequenceClassification`` model applies its head
at every position and then keeps one per row (the last non-pad token), which is one per *packed
row*, not one per sequence. The hook keeps the head's output at every position ((rows, width, 1):
one number per token, nothing like the policy's logits), and the scorer picks each sequence's last
token itself; the forward itself is the engine's, with ZeRO-3's hooks in place.

``offload: true``: under ZeRO-3 the model's engine gets ``offload_param`` on the CPU (DeepSpeed's
ZeRO-Inference path: the partitions live in host memory and each layer is fetched for its forward
and released after it, so nothing of it stays on the accelerator between steps; small parameters are
not kept resident either). Outside ZeRO-3 the module moves to the CPU after scoring and back before.
On a CPU machine both run, moving nothing across a device.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_ds.config.deepspeed_keys import zero_stage
from grpo_ds.config.dtypes import DEEPSPEED_SECTIONS
from grpo_ds.config.reward_specs import RewardModelSpec
from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import Dist
from grpo_ds.errors import UserError, first_line
from grpo_ds.model.batching import pack_micro_batches
from grpo_ds.model.engine import create_reference_engine
from grpo_ds.model.loading import load_saved_tokenizer, partitioned_loading
from grpo_ds.model.weight_files import FILE_ERRORS, FIX, model_weights_problem
from grpo_ds.reward_models.render import render

# where sequence classifiers keep their head (Llama, Qwen2, Mistral...: score)
_HEADS = ("score", "classifier")


def reward_model_ds_config(ds_config: dict, offload: bool, device_type: str = "cpu") -> dict:
    """The DeepSpeed config of one reward model's engine: the run's (its ZeRO stage and precision),
    and with ``offload`` under ZeRO-3 its parameters kept on the host (``offload_param``, nothing
    resident on the device)."""
    cfg = {k: v for k, v in copy.deepcopy(ds_config).items() if k not in ("optimizer", "scheduler")}
    if offload and zero_stage(cfg) == 3:
        zero = cfg.setdefault("zero_optimization", {})
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_model_persistence_threshold"] = 0
    return cfg


def _dtype(ds_config: dict) -> torch.dtype:
    """The precision the run's DeepSpeed config enables (bf16 / fp16 sections), else float32."""
    for name, section in DEEPSPEED_SECTIONS.items():
        if (ds_config.get(section) or {}).get("enabled") is True:
            return getattr(torch, name)
    return torch.float32


@dataclass
class _Model:
    """One loaded reward model."""

    spec: RewardModelSpec
    engine: Any  # DeepSpeed engine without an optimizer
    tokenizer: Any
    max_length: int | None  # the spec's, else the model's window
    # the score head (read through a hook); None: the model's own pooled logits
    head: torch.nn.Module | None
    # why sequences are not packed (None: they are, when packing is asked)
    packing_problem: str | None
    offload_module: bool  # move the module to the CPU between steps (offload outside ZeRO-3)
    pad_id: int


@dataclass(frozen=True)
class Scored:
    """One step's reward-model scores: ``scores[name][i]`` for every sample i of the batch
    (normalised), on every rank, and the step's metrics (per model: its inputs truncated over the
    batch)."""

    scores: dict[str, list[float]]
    metrics: dict[str, float] = field(default_factory=dict)


class RewardModels:
    """The run's reward models, loaded; ``score_models`` is collective (every rank calls it with the
    same batch)."""

    def __init__(
        self, models: list[_Model], micro_tokens: int, packing: bool, device: torch.device
    ):
        self.models, self.micro_tokens, self.packing, self.device = (
            models,
            micro_tokens,
            packing,
            device,
        )

    @staticmethod
    def build(
        specs: Sequence[RewardModelSpec],
        ds_config: dict,
        dist: Dist,
        micro_tokens: int,
        packing: bool = True,
        announce: bool = False,
    ) -> RewardModels:
        """Load each model (partitioned under ZeRO-3: ``zero.Init`` through transformers' DeepSpeed
        integration, as grpo_ds.model.loading loads the policy) with its tokenizer, and wrap it in
        an engine with no optimizer. ``micro_tokens``: the token budget of one micro-batch (real
        tokens packed, rows x longest padded); ``packing``: pack where the model allows it.
        Collective. The folders are checked before (the reward models' pre-load checks), so a
        failure to load here is reported in one line but not explained."""
        models = [_load_model(spec, ds_config, dist, packing, announce) for spec in specs]
        return RewardModels(models, micro_tokens, packing, dist.device)

    def score_models(self, prompts: list[str], completions: list[str], dist: Dist) -> Scored:
        """Every model's normalised score of every sample (``prompts[i] + completions[i]``), on
        every rank."""
        lo, hi = dist.dp_slice(len(prompts))
        rendered, status = [], []
        for m in self.models:
            try:
                ids, truncated = render(
                    m.spec,
                    m.tokenizer,
                    prompts[lo:hi],
                    completions[lo:hi],
                    m.max_length,
                    first_sample=lo,
                )
                # an empty text (no template, no BOS) reads as one pad
                ids = [seq or [m.pad_id] for seq in ids]
                plan = self._plan(ids, m.packing_problem is None)
                rendered.append((ids, plan))
                status.append((None, truncated, len(plan)))
            except UserError as err:
                rendered.append(([], []))
                status.append((err, 0, 0))
        everyone = dist.all_gather(status)
        # every rank raises the same error, before any forward
        for per_model in zip(*everyone, strict=True):
            if errors := [err for err, _, _ in per_model if err is not None]:
                raise errors[0]
        mine: dict[str, list[float]] = {}
        for index, (m, (ids, plan)) in enumerate(zip(self.models, rendered, strict=True)):
            rounds = max(ranks[index][2] for ranks in everyone)
            mine[m.spec.name] = self._forwards(m, ids, plan, rounds)
        parts = dist.dp_parts(dist.all_gather(mine))
        scores = {
            m.spec.name: [s for part in parts for s in part[m.spec.name]] for m in self.models
        }
        metrics: dict[str, float] = {}
        dp_status = dist.dp_parts(everyone)
        # (the scoring's time is the driver's time_reward_model_s)
        for index, m in enumerate(self.models):
            metrics[f"reward_truncated/{m.spec.name}"] = sum(ranks[index][1] for ranks in dp_status)
        return Scored(scores, metrics)

    def _plan(self, ids: list[list[int]], packed: bool) -> list[tuple[int, ...]]:
        """This rank's micro-batches (indices into ``ids``). A text longer than the budget counts as
        the budget: it gets a micro-batch of its own instead of an error (its length is bounded by
        max_length)."""
        capped = {i: min(len(seq), self.micro_tokens) for i, seq in enumerate(ids)}
        return pack_micro_batches(list(capped), capped, max_tokens=self.micro_tokens, packed=packed)

    @torch.no_grad()
    def _forwards(
        self, m: _Model, ids: list[list[int]], plan: list[tuple[int, ...]], rounds: int
    ) -> list[float]:
        """The scores of this rank's share in ``rounds`` forwards (the real micro-batches, then
        dummies)."""
        logits = [0.0] * len(ids)
        if m.offload_module:
            m.engine.module.to(self.device)
        try:
            for i in range(rounds):
                members = plan[i] if i < len(plan) else ()
                # a dummy keeps ZeRO-3's collectives in step
                seqs = [ids[s] for s in members] or [[m.pad_id]]
                values = _last_token_logits(m, seqs, m.packing_problem is None, self.device)
                for s, value in zip(members, values, strict=False):
                    logits[s] = value
        finally:
            if m.offload_module:
                m.engine.module.to("cpu")
        return [(x - m.spec.mean) / m.spec.std for x in logits]


def _last_token_logits(
    m: _Model, seqs: list[list[int]], packed: bool, device: torch.device
) -> list[float]:
    """The model's logit (label 0) at each sequence's last token: one packed row with position ids
    restarting per sequence, or right-padded rows with an attention mask."""
    lengths = [len(s) for s in seqs]
    if packed:
        flat = [t for s in seqs for t in s]
        inputs = {
            "input_ids": torch.tensor([flat], device=device),
            "position_ids": torch.tensor([[p for n in lengths for p in range(n)]], device=device),
        }
        if (getattr(m.engine.module.config, "_attn_implementation", "") or "").startswith(
            "flash_attention"
        ):
            cu = torch.tensor(
                [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
            )
            inputs.update(
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=max(lengths),
                max_length_k=max(lengths),
            )
        last = torch.tensor(lengths).cumsum(0) - 1  # (S,) flat positions
    else:
        width = max(lengths)
        rows = [s + [m.pad_id] * (width - len(s)) for s in seqs]
        inputs = {
            "input_ids": torch.tensor(rows, device=device),
            "attention_mask": (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])
            .long()
            .to(device),
        }
        last = torch.arange(len(seqs)) * width + torch.tensor(lengths) - 1
    # padded only (no head to read per position): the model's own pooling, last non-pad token
    if m.head is None:
        return m.engine(**inputs, use_cache=False).logits[:, 0].float().tolist()
    kept = []
    hook = m.head.register_forward_hook(lambda _module, _args, out: kept.append(out))
    try:
        m.engine(**inputs, use_cache=False)
    finally:
        hook.remove()
    per_token = kept[-1].reshape(-1, kept[-1].shape[-1])  # (rows * width, labels)
    return per_token[last.to(per_token.device), 0].float().tolist()


def _load_model(
    spec: RewardModelSpec, ds_config: dict, dist: Dist, packing: bool, announce: bool
) -> _Model:
    """One reward model, loaded and wrapped in its engine, with its score head found and whether
    its sequences are packed decided."""
    cfg = reward_model_ds_config(ds_config, spec.offload, dist.device.type)
    module, tokenizer = _load_pretrained(spec, cfg, announce)
    engine = create_reference_engine(module, cfg)
    window = getattr(engine.module.config, "max_position_embeddings", None)
    head = next(
        (
            getattr(engine.module, n)
            for n in _HEADS
            if isinstance(getattr(engine.module, n, None), torch.nn.Module)
        ),
        None,
    )
    model = _Model(
        spec,
        engine,
        tokenizer,
        spec.max_length or window,
        head,
        None,
        spec.offload and zero_stage(cfg) != 3,
        tokenizer.pad_token_id or 0,
    )
    model.packing_problem = (
        _packing_problem(model, dist.device) if packing else "train.packing is false"
    )
    if announce and packing and model.packing_problem:
        launcher.say(
            f"note: reward model {spec.name!r}: {model.packing_problem}; padding its micro-batches"
        )
    if model.offload_module:
        engine.module.to("cpu")
    return model


def _load_pretrained(spec: RewardModelSpec, cfg: dict, announce: bool) -> tuple[Any, Any]:
    """(module, tokenizer) from the spec's folder (a failure in one line), each with a pad token."""
    from transformers import AutoModelForSequenceClassification

    try:
        tokenizer = load_saved_tokenizer(spec.path)
        with torch.random.fork_rng(devices=[]), partitioned_loading(cfg):
            module = AutoModelForSequenceClassification.from_pretrained(
                spec.path, dtype=_dtype(cfg), local_files_only=True
            )
    except (ValueError, *FILE_ERRORS) as err:
        # a file damaged since the pre-load checks is named; else the library's error
        if problem := model_weights_problem(Path(spec.path)):
            raise UserError(f"reward model {spec.name!r}", problem, FIX) from None
        raise UserError(
            f"reward model {spec.name!r}",
            f"cannot load {spec.path} ({first_line(err)})",
            "the folder needs config.json, the weights and the tokenizer files",
        ) from None
    # only pads the rows of a padded micro-batch: any token does
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if announce:
            launcher.say(
                f"note: reward model {spec.name!r}: its tokenizer has no pad token; "
                f"padding with {tokenizer.pad_token!r} (never "
                "scored: each sequence is read at its last token)"
            )
    # its pooling (unused here) refuses rows > 1 without one
    if module.config.pad_token_id is None:
        module.config.pad_token_id = tokenizer.pad_token_id
    return module, tokenizer


def _packing_problem(m: _Model, device: torch.device) -> str | None:
    """Why the model cannot score packed sequences, found by trying (collective under ZeRO-3): two
    short sequences packed in one row must score as each does alone."""
    if m.head is None:
        return (
            f"no score head found (none of {', '.join(_HEADS)}) "
            "to read at each packed sequence's end"
        )
    vocab = getattr(m.engine.module.config, "vocab_size", 16) or 16
    seqs = [[1 % vocab, 2 % vocab, 3 % vocab, 4 % vocab], [5 % vocab, 6 % vocab, 7 % vocab]]
    try:
        with torch.no_grad():
            alone = torch.tensor([_last_token_logits(m, [s], False, device)[0] for s in seqs])
            packed = torch.tensor(_last_token_logits(m, seqs, True, device))
    except Exception as err:  # noqa: BLE001 - any failure means: do not pack
        return f"a packed forward fails ({type(err).__name__}: {first_line(err)})"
    if (packed - alone).abs().max() > 1e-3 * alone.abs().max().clamp(min=1.0):
        name = getattr(m.engine.module.config, "_attn_implementation", "?")
        return (
            f"{type(m.engine.module).__name__} with attention "
            f"{name!r} attends across packed sequences"
        )
    return None
