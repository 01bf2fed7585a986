"""The router's load-balancing loss of a mixture-of-experts model (Switch Transformer; Fedus et al.
2021, arXiv:2101.03961, eqs. 4-6), as transformers' MoE models compute it (Mixtral, Qwen2/3-MoE,
OLMoE).

Each layer's router gives every token t a distribution p_t = softmax(router logits_t) over E experts
and sends it to its top-k experts. Over the rows r = (layer, token) of one forward, real tokens
only:

    f_e = (1 / R) sum_r [e in top-k(p_r)]        the share of routing decisions that went to expert
                                                 e (sums to k)
    P_e = (1 / R) sum_r p_re                     the mean router probability of expert e
    L_aux = E x sum_e f_e P_e

L_aux is smallest when routing is uniform; f_e is a count (no gradient), so the gradient reaches the
router through P_e only. The rows of all layers are pooled before the product (as transformers pools
them), so L_aux is a product of means over one forward's tokens: it is not a sum over tokens, and
two forwards over halves of a batch do not give the loss of one forward over all of it
(docs/guides/large-models.md says what that means for a step's loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """L_aux (a scalar, float32) of one forward. ``router_logits``: one (T, E) tensor per MoE layer,
    the same T token rows in each; ``token_mask``: T values (any shape), 1 for a real token, 0 for
    padding (None: every row is real)."""
    layers = len(router_logits)
    if layers == 0:
        raise ValueError(
            "no router logits: the model has no MoE layer, or the forward did not return them"
        )
    logits = torch.cat([layer.float() for layer in router_logits])  # (layers x T, E)
    experts = logits.shape[-1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    probs = torch.softmax(logits, dim=-1)  # (layers x T, E)
    if token_mask is None:
        mask = torch.ones(logits.shape[0], device=logits.device)
    else:
        # (layers x T,)
        mask = token_mask.reshape(-1).to(device=logits.device, dtype=torch.float32).repeat(layers)
    if mask.numel() != logits.shape[0]:
        raise ValueError(
            f"token_mask has {mask.numel() // layers} values "
            f"for {logits.shape[0] // layers} router rows"
        )
    chosen = probs.detach().topk(top_k, dim=-1).indices  # (layers x T, k)
    counts = torch.zeros(experts, device=logits.device).scatter_add_(
        0, chosen.reshape(-1), mask.repeat_interleave(top_k)
    )
    rows = mask.sum()
    routed_share = counts / rows  # f_e
    mean_prob = (probs * mask[:, None]).sum(dim=0) / rows  # P_e
    return experts * (routed_share * mean_prob).sum()
