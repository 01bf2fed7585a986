"""One micro-batch's loss on the flat token layout, and how it reaches DeepSpeed's gradients.

Loss contract (docs/concepts/loss-normalisation.md). The loss of one optimizer step is sum_i w_i
sum_t l_it over the whole global mini-batch: w_i comes from grpo_ds.algo.aggregation (computed on
every sequence of the mini-batch, by the update phase) and l_it from grpo_ds.algo.policy_loss. A
micro-batch contributes its partial sum

    loss = sum_t token_weight_t * l_t,     token_weight_t = w_i(t) x loss mask_t x importance
                                           weight_t

over its flat tokens (``TokenTerms``). ``backward`` hands it to DeepSpeed so that the summed
partials, not an average of them, become the gradient: DeepSpeed averages gradients over the
data-parallel ranks (under ZeRO-3 with sequence parallelism, over the data- and sequence-parallel
ranks, each of which holds a slice of the micro-batch's tokens), so the partial loss is multiplied
by that many ranks, and ``scale_wrt_gas=False`` stops it from dividing by its accumulation steps
(the resolved config sets ``managed_gradient_accumulation`` false, see grpo_ds.config.deepspeed,
because the driver owns the optimizer-step boundary). The result does not depend on world size,
micro-batch size, dynamic batching or padding micro-batches.

``micro_batch_loss`` has three variants behind one call, all on the same flat tokens:
- **gspo** (sequence-level ratio): the kernels give every token's log-prob and entropy, then the
  reference math (grpo_ds.algo.policy_loss.token_losses) needs whole sequences at once;
- **fused lm_head** (``LossSettings.fused_lm_head``): the model's lm_head is swapped, for one
  forward, for the fused-linear kernels, so (tokens x vocab) logits never exist. The swap happens
  inside the lm_head module's call, so DeepSpeed's ZeRO-3 hooks gather the (partitioned) weight for
  it as for any forward, and gather it again for the backward. The swapped head returns the loss and
  its statistics as one small tensor;
- **full logits**: the model computes the logits, the logits kernels score the trained tokens and
  the masked policy-loss kernel sums them per sequence.

Mixture-of-experts models with ``model.router_aux_loss_coef`` c > 0
(``LossSettings.router_aux_coef``) add the router's load-balancing loss L_aux(mb)
(grpo_ds.algo.router, over the tokens the forward read) to every trained token's loss:

    loss += c x L_aux(mb) x sum_t token_weight_t

so it is weighted like the policy loss's tokens (token-mean: the micro-batch's share of the step's
trained tokens) and is zero for a padding micro-batch. L_aux is a product of means over one forward,
not a sum over tokens: this is the one term of the step loss that depends on the micro-batch layout
(docs/guides/large-models.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

from grpo_ds import kernels
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.algo.router import load_balancing_loss
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation
from grpo_ds.step.micro_batch import MicroBatch, as_sequence_rows


@dataclass(frozen=True)
class LossSettings:
    config: LossConfig
    # the sampling temperature: log-probs are those of softmax(logits / temperature)
    temperature: float
    backend: str  # resolved kernels backend: "triton" or "torch"
    # tokens per chunk of the log-prob kernels; None: as many as chunk_mib holds
    chunk_tokens: int | None
    # the recipe asks for it and the model allows it (grpo_ds.model.policy decides, once)
    fused_lm_head: bool
    # a chunk's working-set budget (kernels.logprob_chunk_mib) when chunk_tokens is None
    chunk_mib: float = 64.0
    # the sampler's top-k and top-p: every log-prob (policy, old policy, reference) and entropy is
    # taken over the set the sampler drew from (grpo_ds.algo.truncation;
    # docs/concepts/truncated-sampling.md)
    truncation: Truncation = NO_TRUNCATION
    # model.router_aux_loss_coef: c of the MoE routers' load-balancing loss; 0 = off
    router_aux_coef: float = 0.0

    def chunk(self, vocab: int, dtype: torch.dtype) -> int:
        """Tokens per chunk for a (tokens x ``vocab``) working set of ``dtype`` logits."""
        return kernels.logprob_chunk_tokens(
            vocab, dtype, self.backend, self.chunk_mib, self.chunk_tokens
        )


@dataclass
class TokenTerms:
    """The inputs of one micro-batch's loss besides the model's own output."""

    advantages: torch.Tensor  # (S,) one per sequence
    # (N,) w_i x loss mask x importance weight; 0 = the token trains nothing
    token_weight: torch.Tensor
    old_logprobs: torch.Tensor | None  # (N,) None: on-policy (the ratio is exactly 1)
    ref_logprobs: torch.Tensor | None  # (N,) None: no KL term in the loss


@dataclass
class LossStats:
    """Sums over the trained tokens (token_weight > 0) of micro-batches, for the step's metrics."""

    loss: float = 0.0  # the step loss sum_i w_i sum_t l_it
    kl: float = 0.0  # sum of KL_t
    entropy: float = 0.0  # sum of H_t
    clipped_tokens: float = 0.0  # tokens whose loss a clip changed
    response_tokens: float = 0.0  # the model's response tokens (loss mask 1), trained or not
    sequence_tokens: float = 0.0  # prompt + response tokens the model read
    # MoE with router_aux_loss_coef > 0: sum of L_aux(mb) x mb's response tokens
    router_aux: float = 0.0
    # the response tokens of those micro-batches (router_aux's denominator)
    router_aux_tokens: float = 0.0

    def router_metrics(self) -> dict:
        """``router_aux_loss``: L_aux averaged over the step's micro-batches by their response
        tokens, where the load-balancing loss is on (else nothing)."""
        return (
            {"router_aux_loss": self.router_aux / self.router_aux_tokens}
            if self.router_aux_tokens
            else {}
        )

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def summed_over_ranks(self, dist) -> LossStats:
        """The sums over every sample of the step: over the ranks, once per tensor-parallel group
        (whose ranks compute the same); sequence-parallel ranks each hold a slice of every sequence,
        so they all count."""
        totals = torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)
        dist.all_reduce_sum(totals)
        return LossStats(*(totals / dist.tp_size).tolist())


def micro_batch_loss(
    model, mb: MicroBatch, terms: TokenTerms, s: LossSettings
) -> tuple[torch.Tensor, LossStats]:
    """(sum_t token_weight_t * l_t (+ the router's term), differentiable; this micro-batch's
    LossStats, zero for a padding one)."""
    coef = s.router_aux_coef
    routed = [] if coef > 0 else None  # the forward's router logits, one (T, E) per MoE layer
    if s.config.policy_loss == "gspo":
        loss, sums = _gspo_loss(model, mb, terms, s, routed)
    elif s.fused_lm_head:
        loss, sums = _fused_head_loss(model, mb, terms, s, routed)
    else:
        loss, sums = _logits_loss(model, mb, terms, s, routed)
    aux = None
    if routed is not None:
        aux = load_balancing_loss(routed, _unwrap(model).config.num_experts_per_tok, mb.token_mask)
        loss = loss + coef * aux * terms.token_weight.sum()
    if mb.padding:
        return loss, LossStats()
    kl, entropy, clipped = (float(t) for t in torch.stack(sums).detach().double().cpu())
    response = float(mb.loss_mask.sum())
    routing = (aux.item() * response, response) if aux is not None else (0.0, 0.0)
    return loss, LossStats(
        loss.item(), kl, entropy, clipped, response, float(mb.sequence_tokens), *routing
    )


def _gspo_loss(
    model, mb: MicroBatch, terms: TokenTerms, s: LossSettings, routed: list | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """GSPO's sequence-level ratio: the reference's token losses on the log-probs (the loss; the
    KL, entropy and clipped sums over the counted tokens)."""
    logprobs, entropy = _logprobs_and_entropy(model, mb, s, routed)
    per_token, kl, clipped = token_losses(
        logprobs,
        terms.old_logprobs,
        terms.advantages[mb.seq_index],
        terms.ref_logprobs,
        entropy,
        s.config,
        (mb.seq_index, terms.token_weight),
    )
    loss = (per_token * terms.token_weight).sum()
    return loss, _counted_sums(terms.token_weight, kl, entropy, clipped)


def _counted_sums(token_weight: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``values`` (per token) summed over the tokens the loss counts (weight > 0),
    detached, in float32."""
    counted = token_weight > 0
    return [torch.where(counted, t.detach().float(), 0.0).sum() for t in values]


def _fused_head_loss(
    model, mb: MicroBatch, terms: TokenTerms, s: LossSettings, routed: list | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss from the hidden states through the lm_head in chunks, without the logits."""
    inputs = kernels.LossInputs(
        mb.target_ids,
        terms.advantages[mb.seq_index],
        terms.token_weight,
        terms.old_logprobs,
        terms.ref_logprobs,
    )

    # (B, T, H) -> (4,): the loss (differentiable), then KL, entropy, clipped sums
    def head(module, hidden):
        weight = module.weight
        out = kernels.policy_loss_from_hidden(
            _trained_positions(hidden, mb),
            weight,
            inputs,
            s.config,
            s.temperature,
            s.chunk(weight.shape[0], weight.dtype),
            s.backend,
            s.truncation,
        )
        sums = _counted_sums(terms.token_weight, out.kl, out.entropy, out.clipped)
        return torch.stack([out.loss.float(), *sums])

    packed = _forward_with_head(model, mb, head, routed)
    return packed[0], list(packed[1:])


def _logits_loss(
    model, mb: MicroBatch, terms: TokenTerms, s: LossSettings, routed: list | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss from the model's logits: log-probs, then the masked per-sequence policy loss."""
    logits = _logits(model, mb, routed)
    logprobs, entropy = kernels.logprobs_from_logits(
        logits,
        mb.target_ids,
        mb.logit_index,
        s.temperature,
        s.chunk(logits.shape[-1], logits.dtype),
        s.backend,
        s.truncation,
    )  # (N,)

    def rows(values):
        return None if values is None else as_sequence_rows(values.float(), mb)

    per_sequence = kernels.masked_policy_loss(
        rows(logprobs),
        terms.advantages,
        rows(terms.token_weight),
        s.config,
        rows(terms.old_logprobs),
        rows(terms.ref_logprobs),
        rows(entropy),
        s.backend,
    )
    sums = [t.sum() for t in (per_sequence.kl, per_sequence.entropy, per_sequence.clipped)]
    return per_sequence.loss.sum(), sums


@torch.no_grad()
def token_logprobs(model, mb: MicroBatch, s: LossSettings) -> torch.Tensor:
    """Log-probs (N,) float32 of the micro-batch's response tokens under softmax(logits / T) over
    the sampler's set; no gradient."""
    return _logprobs_and_entropy(model, mb, s)[0]


def backward(engine, loss: torch.Tensor, averaged_over: int) -> None:
    """Accumulate d(step loss)/d(weights) for this micro-batch's partial sum; ``averaged_over``: the
    ranks DeepSpeed averages gradients over (see the module docstring)."""
    engine.backward(loss * averaged_over, scale_wrt_gas=False)


def discard_gradients(engine) -> None:
    """Forget the gradients accumulated since the last optimizer step without stepping (the NaN
    guard): ZeRO's next backward then overwrites its gradient partitions (as after a step)."""
    engine.optimizer.zero_grad()
    # The one read of DeepSpeed's private state: its count of backwards since the last step, which
    # decides when unmanaged accumulation starts a new step. It has no public reset, and a step that
    # was skipped must start over.
    if hasattr(engine, "_unmanaged_backward_count"):
        engine._unmanaged_backward_count = 0


# ----------------------------------------------------------------------------------------- forwards


def _logprobs_and_entropy(
    model, mb: MicroBatch, s: LossSettings, routed: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if s.fused_lm_head:

        def head(module, hidden):  # (B, T, H) -> (2, N): log-probs and entropies
            weight = module.weight
            return torch.stack(
                kernels.logprobs_from_hidden(
                    _trained_positions(hidden, mb),
                    weight,
                    mb.target_ids,
                    s.temperature,
                    s.chunk(weight.shape[0], weight.dtype),
                    s.backend,
                    s.truncation,
                )
            )

        both = _forward_with_head(model, mb, head, routed)
        return both[0], both[1]
    logits = _logits(model, mb, routed)
    return kernels.logprobs_from_logits(
        logits,
        mb.target_ids,
        mb.logit_index,
        s.temperature,
        s.chunk(logits.shape[-1], logits.dtype),
        s.backend,
        s.truncation,
    )


def _trained_positions(hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    # (B, T, H) or (1, sum L_i, H) -> (N, H)
    return hidden.reshape(-1, hidden.shape[-1])[mb.logit_index]


def _unwrap(model):
    return getattr(model, "module", model)  # a DeepSpeed engine wraps the transformers model


@contextmanager
def _lm_head_replaced(model, head_fn):
    head = _unwrap(model).get_output_embeddings()
    # the instance attribute shadows the class's forward
    head.forward = lambda hidden: head_fn(head, hidden)
    try:
        yield
    finally:
        del head.forward


def _forward(model, mb: MicroBatch, routed: list | None):
    """The model's output; with ``routed`` a list, the MoE routers' logits are asked for and
    appended to it."""
    if routed is None:
        return model(**mb.model_inputs())
    out = model(**mb.model_inputs(), output_router_logits=True)
    routed.extend(out.router_logits)
    return out


def _forward_with_head(model, mb: MicroBatch, head_fn, routed: list | None = None) -> torch.Tensor:
    with _lm_head_replaced(model, head_fn):
        return _forward(model, mb, routed).logits


def _logits(model, mb: MicroBatch, routed: list | None = None) -> torch.Tensor:
    logits = _forward(model, mb, routed).logits  # (B, T, V) padded, (1, sum L_i, V) packed
    return logits.view(-1, logits.shape[-1])  # one row per position
