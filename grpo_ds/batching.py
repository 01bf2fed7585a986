"""From sample ids to tensors, and from a model forward to per-token log-probs and the policy loss.

A training sequence is prompt + response with no padding inside it, right-padded to the longest
sequence of its micro-batch; the logits at position p-1 predict the token at p, so response token t of
a sample with prompt length P is scored by the logits at P + t - 1. Per-token tensors are flat over
all response tokens of the micro-batch, with ``seq_index`` saying which sample each token belongs to.

The per-token math runs through grpo_ds.kernels with the run's backend. With ``fused_lm_head`` (the
default) the model's lm_head is swapped, for one forward, for a function of the hidden states that calls
the fused-linear kernels: full (tokens x vocab) logits never exist. The swap happens inside the lm_head
module's call, so DeepSpeed's ZeRO-3 hooks gather the (partitioned) weight for it as for any forward, and
gather it again for the backward. Without it the model computes full logits and the logits kernels score
the response rows.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grpo_ds import kernels
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.rollout.base import Rollouts


@dataclass
class MicroBatchTensors:
    sample_ids: list[int]
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    row: torch.Tensor  # (N_tok,) batch row of each response token
    logit_pos: torch.Tensor  # (N_tok,) position whose logits predict the token
    target_ids: torch.Tensor  # (N_tok,)
    seq_index: torch.Tensor  # (N_tok,) index into sample_ids
    col: torch.Tensor  # (N_tok,) index of the token within its response
    loss_mask: torch.Tensor  # (N_tok,) float32: 1 for a token the model sampled, 0 for an observation token

    @property
    def num_tokens(self) -> int:
        return int(self.target_ids.numel())


@dataclass(frozen=True)
class KernelSettings:
    backend: str  # resolved: "triton" or "torch"
    chunk_tokens: int
    fused_lm_head: bool


def collate(rollouts: Rollouts, sample_ids: list[int], pad_id: int, device: torch.device) -> MicroBatchTensors:
    seqs = [rollouts.prompt_ids[s] + rollouts.response_ids[s] for s in sample_ids]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    row, pos, col, loss_mask = [], [], [], []
    for b, (sid, seq) in enumerate(zip(sample_ids, seqs, strict=True)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        p, r = len(rollouts.prompt_ids[sid]), len(rollouts.response_ids[sid])
        row += [b] * r
        pos += list(range(p - 1, p + r - 1))
        col += list(range(r))
        loss_mask += rollouts.token_loss_mask(sid)
    row_t, pos_t = torch.tensor(row, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
    return MicroBatchTensors(sample_ids=list(sample_ids), input_ids=input_ids.to(device),
                             attention_mask=attention_mask.to(device), row=row_t.to(device), logit_pos=pos_t.to(device),
                             target_ids=input_ids[row_t, pos_t + 1].to(device), seq_index=row_t.to(device),
                             col=torch.tensor(col, dtype=torch.long).to(device),
                             loss_mask=torch.tensor(loss_mask, dtype=torch.float32).to(device))


def response_logprobs(model, mb: MicroBatchTensors, temperature: float, ks: KernelSettings) -> torch.Tensor:
    """Log-probs (N_tok,) float32 of the response tokens under softmax(logits / T); no gradient."""
    with torch.no_grad():
        return _model_logprobs(model, mb, temperature, ks)[0]


@dataclass
class LossTerms:
    """The inputs of one micro-batch's loss besides the model's own output."""

    advantages: torch.Tensor  # (B,) one per sequence
    sequence_weight: torch.Tensor  # (B,) w_i of the step loss (grpo_ds.algo.aggregation); 0 for padding
    token_factor: torch.Tensor  # (N_tok,) loss mask x importance weight
    old_logprobs: torch.Tensor | None  # (N_tok,) None: on-policy
    ref_logprobs: torch.Tensor | None  # (N_tok,) None: no KL in the loss


def response_policy_loss(model, mb: MicroBatchTensors, terms: LossTerms, cfg: LossConfig, temperature: float,
                         ks: KernelSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i w_i sum_t f_t l_it, differentiable; [KL sum, entropy sum, clipped count] (3,) float64 over the
    trained tokens of weighted sequences). f_t is ``terms.token_factor``."""
    counted = (terms.sequence_weight[mb.seq_index] > 0) & (terms.token_factor > 0)  # (N_tok,)

    def totals(kl, entropy, clipped):
        return torch.stack([torch.where(counted, t.detach().float(), 0.0).sum() for t in (kl, entropy, clipped)]
                           ).double().cpu()

    token_weight = terms.sequence_weight[mb.seq_index] * terms.token_factor  # (N_tok,)
    if cfg.policy_loss != "ppo_clip":  # sequence-level (GSPO): kernels for the log-probs, the reference loss
        logprobs, entropy = _model_logprobs(model, mb, temperature, ks)
        per_token, kl, clipped = token_losses(logprobs, terms.old_logprobs, terms.advantages[mb.seq_index],
                                              terms.ref_logprobs, entropy, cfg, (mb.seq_index, terms.token_factor))
        return (per_token * token_weight).sum(), totals(kl, entropy, clipped)
    if _use_fused(model, ks):
        inputs = kernels.LossInputs(mb.target_ids, terms.advantages[mb.seq_index], token_weight, terms.old_logprobs,
                                    terms.ref_logprobs)
        stats = {}

        def head(module, hidden):  # (B, T, H) -> () loss; the hooks of ZeRO-3 wrap what this returns
            out = kernels.policy_loss_from_hidden(hidden[mb.row, mb.logit_pos], module.weight, inputs, cfg,
                                                  temperature, ks.chunk_tokens, ks.backend)
            stats["totals"] = totals(out.kl, out.entropy, out.clipped)
            return out.loss

        return _forward_with_head(model, mb, head), stats["totals"]
    logits = _logits(model, mb)  # (B*T, V)
    logprobs, entropy = kernels.logprobs_from_logits(logits, mb.target_ids, _logit_rows(mb), temperature,
                                                     ks.chunk_tokens, ks.backend)  # (N_tok,)
    shape = len(mb.sample_ids), int(mb.col.max()) + 1 if mb.num_tokens else 0

    def as_rows(values):
        return None if values is None else _to_rows(values.float(), mb, shape)

    sums = kernels.masked_policy_loss(as_rows(logprobs), terms.advantages, as_rows(terms.token_factor), cfg,
                                      as_rows(terms.old_logprobs), as_rows(terms.ref_logprobs), as_rows(entropy),
                                      ks.backend)
    keep = terms.sequence_weight > 0  # (B,)
    sequence_totals = torch.stack([torch.where(keep, t, 0.0).sum() for t in (sums.kl, sums.entropy, sums.clipped)])
    return (sums.loss * terms.sequence_weight).sum(), sequence_totals.detach().double().cpu()


def _model_logprobs(model, mb: MicroBatchTensors, temperature: float, ks: KernelSettings
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_fused(model, ks):
        def head(module, hidden):  # (B, T, H) -> (2, N_tok): log-probs and entropies
            return torch.stack(kernels.logprobs_from_hidden(hidden[mb.row, mb.logit_pos], module.weight,
                                                            mb.target_ids, temperature, ks.chunk_tokens, ks.backend))
        both = _forward_with_head(model, mb, head)
        return both[0], both[1]
    return kernels.logprobs_from_logits(_logits(model, mb), mb.target_ids, _logit_rows(mb), temperature,
                                        ks.chunk_tokens, ks.backend)


def split_per_sample(values: torch.Tensor, mb: MicroBatchTensors) -> dict[int, torch.Tensor]:
    """Flat per-token values -> {sample id: (L_i,) tensor on CPU}."""
    values = values.detach().float().cpu()
    seq = mb.seq_index.cpu()
    return {sid: values[seq == b] for b, sid in enumerate(mb.sample_ids)}


def _use_fused(model, ks: KernelSettings) -> bool:
    # Final-logit soft-capping (e.g. Gemma 2) transforms the logits after the lm_head, and a LoRA adapter on the
    # lm_head adds its own product: the fused path (hidden states x the lm_head weight) would skip either, so such
    # models go through full logits.
    module = _unwrap(model)
    config = getattr(module, "config", None)
    head = module.get_output_embeddings()
    return (ks.fused_lm_head and getattr(config, "final_logit_softcapping", None) is None
            and not hasattr(head, "lora_A"))


def _unwrap(model):
    return getattr(model, "module", model)  # a DeepSpeed engine wraps the transformers model


@contextmanager
def _lm_head_replaced(model, head_fn):
    head = _unwrap(model).get_output_embeddings()
    head.forward = lambda hidden: head_fn(head, hidden)  # the instance attribute shadows the class's forward
    try:
        yield
    finally:
        del head.forward


def _forward_with_head(model, mb: MicroBatchTensors, head_fn) -> torch.Tensor:
    with _lm_head_replaced(model, head_fn):
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits


def _logits(model, mb: MicroBatchTensors) -> torch.Tensor:
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits  # (B, T, V)
    return logits.view(-1, logits.shape[-1])  # (B*T, V)


def _logit_rows(mb: MicroBatchTensors) -> torch.Tensor:
    return mb.row * mb.input_ids.shape[1] + mb.logit_pos  # (N_tok,) rows of the (B*T, V) logits


def _to_rows(values: torch.Tensor, mb: MicroBatchTensors, shape: tuple[int, int]) -> torch.Tensor:
    out = values.new_zeros(shape)  # (B, R)
    return out.index_put((mb.seq_index, mb.col), values)
