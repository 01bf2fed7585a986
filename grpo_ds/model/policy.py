"""The policy being trained: its DeepSpeed engine, its KL reference, and what leaves it (rollout
weights, checkpoints, the final model). Full fine-tuning or LoRA is decided once, here, when it is
built.

                  full fine-tuning                        LoRA (model.lora_rank, grpo_ds.model.lora)
    engine        ZeRO engine over every weight           ZeRO engine over the peft model; only
                  adapters train
    reference     a second, frozen ZeRO engine (kl > 0)   the policy's own engine with its adapters
                  disabled
    rollout sync  every weight, bucket by bucket          W + scaling * B @ A of each adapted layer
    checkpoint    every weight and its optimizer state    the adapters and their optimizer state
    final model   every weight                            the base with the adapters merged

Under ZeRO-3 the policy and the reference are loaded partitioned (grpo_ds.model.loading.load_model):
no rank ever holds either whole, except rank 0 while it writes the final model.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_ds.config.deepspeed import one_rank_stage_note
from grpo_ds.config.recipe import Recipe
from grpo_ds.distributed import launcher
from grpo_ds.model import lora, sequence_parallel
from grpo_ds.model.engine import (
    create_reference_engine,
    create_train_engine,
    share_fp32_master,
    shared_master_note,
)
from grpo_ds.model.loading import load_model
from grpo_ds.model.weight_gather import gathered_named_parameters


@dataclass
class Policy:
    engine: Any  # the DeepSpeed engine being trained
    lora: bool  # only LoRA adapters train (decided from model.lora_rank when built)
    # scores the KL reference (LoRA: ``engine`` itself, adapters off); None: no KL
    reference_engine: Any | None
    # why the fused lm_head kernels cannot run on this model (None: they can)
    fused_lm_head_problem: str | None
    # why this model cannot take packed micro-batches (None: it can)
    packing_problem: str | None = None

    @staticmethod
    def build(recipe: Recipe, ds_config: dict, vocab_size: int, announce: bool) -> Policy:
        """Load the model (partitioned under ZeRO-3), wrap it in its engine and build its reference.
        ``announce``: print the one-line notes (LoRA summary, fused-head fallback) on this rank."""
        use_lora = lora.enabled(recipe.model)
        model = load_model(recipe.model, vocab_size, recipe.run.seed, ds_config)
        if use_lora:
            model = lora.apply_lora(model, recipe.model)
        sp = recipe.train.sequence_parallel_size
        mpu = (
            sequence_parallel.register(model, sp, recipe.sequence_parallel_rows) if sp > 1 else None
        )
        engine = create_train_engine(model, ds_config, mpu)
        shared_bytes = share_fp32_master(engine)
        reference = None
        if recipe.algorithm.kl_coef > 0:
            reference = (
                engine
                if use_lora
                else create_reference_engine(
                    load_model(recipe.model, vocab_size, recipe.run.seed, ds_config), ds_config, mpu
                )
            )
        packing = None
        if recipe.train.packing:
            packing = (
                "sequence parallelism drops attention masks, which packed rows need"
                if sp > 1
                else packing_problem(engine)
            )
        policy = Policy(engine, use_lora, reference, fused_lm_head_problem(engine.module), packing)
        if announce:
            if stage_note := one_rank_stage_note(recipe, ds_config):
                launcher.say(f"note: {stage_note}")
            if shared_bytes:
                launcher.say(f"note: {shared_master_note(shared_bytes)}")
            if use_lora:
                launcher.say(lora.summary(engine.module, recipe.model.lora_rank))
            if recipe.kernels.fused_lm_head and policy.fused_lm_head_problem:
                launcher.say(
                    "note: kernels.fused_lm_head: "
                    f"{policy.fused_lm_head_problem}; computing full logits"
                )
            if packing:
                launcher.say(f"note: train.packing: {packing}; padding each micro-batch instead")
        return policy

    @property
    def fused_lm_head_allowed(self) -> bool:
        return self.fused_lm_head_problem is None

    @property
    def packing_allowed(self) -> bool:
        return self.packing_problem is None

    @property
    def packs_one_row(self) -> bool:
        """Flash attention takes packed sequences' boundaries, so one row holds them all
        (grpo_ds.step.micro_batch)."""
        name = (
            getattr(getattr(self.engine.module, "config", None), "_attn_implementation", "") or ""
        )
        return name.startswith("flash_attention")

    @contextmanager
    def reference(self):
        """The engine that scores the reference policy, for the duration (LoRA: the adapters are
        off)."""
        if self.reference_engine is None:
            raise RuntimeError("this policy has no reference model (algorithm.kl_coef is 0)")
        if self.lora:
            with lora.adapters_disabled(self.reference_engine):
                yield self.reference_engine
        else:
            yield self.reference_engine

    def rollout_weights(
        self, bucket_bytes: int, whole_layers: dict[str, list[str]] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends the rollout engine (every rank must consume it to the end):
        every weight, or under LoRA the merged adapted layers, plus, where the engine rebuilds each
        layer whole (``whole_layers``: its fused layer names -> member names), the frozen tensors
        that complete those layers (lora.layer_companions)."""
        if self.lora:
            merged = lora.merged_weights(self.engine.module, bucket_bytes)
            if whole_layers:
                return itertools.chain(
                    lora.layer_companions(self.engine.module, bucket_bytes, whole_layers), merged
                )
            return merged
        return gathered_named_parameters(self.engine.module, bucket_bytes)

    def full_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight of the model the policy stands for (LoRA: merged), under transformers'
        names, bucket by bucket (every rank must consume it to the end; each tensor is valid until
        the next)."""
        if self.lora:
            return lora.merged_model_weights(self.engine.module, bucket_bytes)
        return gathered_named_parameters(self.engine.module, bucket_bytes)

    def final_weights(
        self, bucket_bytes: int, keep: bool
    ) -> tuple[str, dict[str, torch.Tensor] | None]:
        """(``weights_sha256`` of ``full_weights``, the same on every rank; with ``keep``, those
        weights as a CPU state dict). Collective: every rank calls it."""
        state: dict[str, torch.Tensor] = {}
        digests = {}
        for name, tensor in self.full_weights(bucket_bytes):
            digests[name] = _tensor_sha256(tensor)
            if keep:
                state[name] = tensor.detach().to("cpu", copy=True)
        return _combine(digests), (state if keep else None)

    def save_pretrained(self, folder: Path, state: dict[str, torch.Tensor], tokenizer) -> None:
        """Write ``state`` (from ``final_weights``) and the tokenizer as a transformers folder into
        ``folder``: the temporary one of grpo_ds.run.writes.folder_written, which puts it in place
        once it is complete."""
        module = self.engine.module.get_base_model() if self.lora else self.engine.module
        # transformers draws a progress bar per shard
        with contextlib.redirect_stderr(io.StringIO()):
            module.save_pretrained(folder, state_dict=state)
        tokenizer.save_pretrained(folder)

    def save_state(self, folder: Path, tag: str) -> None:
        """The engine's sharded state into ``folder/tag`` (collective); a LoRA policy's frozen base
        is left out: it is rebuilt from model.path on resume and export."""
        self.engine.save_checkpoint(str(folder), tag=tag, exclude_frozen_parameters=self.lora)

    def load_state(self, folder: Path, tag: str) -> bool:
        """Restore weights, optimizer and lr schedule from ``folder/tag``; False if DeepSpeed found
        nothing."""
        load_path, _ = self.engine.load_checkpoint(
            str(folder),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not self.lora,
        )
        share_fp32_master(self.engine)
        return load_path is not None


def fused_lm_head_problem(module: torch.nn.Module) -> str | None:
    """The fused path computes hidden states x the lm_head weight; a model that changes its logits
    after that product, or an lm_head that adds its own (a LoRA adapter), would be skipped by it."""
    config = getattr(module, "config", None)
    head = module.get_output_embeddings()
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the model soft-caps its final logits (final_logit_softcapping)"
    if hasattr(head, "lora_A"):
        return "the lm_head has a LoRA adapter"
    if getattr(head.weight, "ds_is_replaced_module", False):
        return "tensor parallelism splits the lm_head weight over ranks"
    return None


def weights_sha256(named_tensors) -> str:
    """One digest of (name, tensor) pairs that does not depend on their order (float32 bytes of each
    tensor)."""
    return _combine({name: _tensor_sha256(tensor) for name, tensor in named_tensors})


def _tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def _combine(digests: dict[str, str]) -> str:
    return hashlib.sha256(
        "".join(f"{n}:{d}\n" for n, d in sorted(digests.items())).encode()
    ).hexdigest()


@torch.no_grad()
def packing_problem(engine) -> str | None:
    """Why the model cannot take packed micro-batches (grpo_ds.step.micro_batch), found by trying:
    two short sequences packed into one row must give the logits each gives alone. A model whose
    attention ignores the position ids' boundaries (remote code, an attention implementation without
    packed-sequence support) attends across them. Every rank runs it (ZeRO-3 gathers the weights
    collectively)."""
    module = getattr(engine, "module", engine)  # a DeepSpeed engine, or a plain model
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", 2) or 2
    first, second = [1 % vocab, 2 % vocab, 3 % vocab, 4 % vocab], [5 % vocab, 6 % vocab, 7 % vocab]
    device = getattr(engine, "device", None) or next(module.parameters()).device
    was_training = module.training
    module.eval()
    try:
        alone = [
            engine(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
            for ids in (first, second)
        ]
        packed = (
            engine(
                input_ids=torch.tensor([first + second], device=device),
                use_cache=False,
                position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]], device=device),
            )
            .logits[0]
            .float()
        )
    except Exception as err:  # noqa: BLE001 - any failure means: do not pack
        return (
            f"a packed forward fails ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        )
    finally:
        module.train(was_training)
    expected = torch.cat(alone)
    scale = expected.abs().max().clamp(min=1.0)
    # attention across sequences changes the logits by far more
    if (packed - expected).abs().max() > 1e-2 * scale:
        name = getattr(config, "_attn_implementation", "?")
        return f"{type(module).__name__} with attention {name!r} attends across packed sequences"
    return None
