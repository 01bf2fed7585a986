"""grpo_ds.kernels.logprobs_from_hidden and policy_loss_from_hidden (Triton:
grpo_ds/kernels/fused_linear.py; torch: chunked.py) against the references grpo_ds.algo.logprobs and
grpo_ds.algo.policy_loss.token_losses, on outputs and the gradients of the hidden states and the
lm_head weight."""

import itertools

import pytest
import torch

from grpo_ds import kernels
from grpo_ds.algo.logprobs import token_logprobs_and_entropy
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.algo.truncation import NO_TRUNCATION, Truncation
from grpo_ds.kernels import LossInputs
from tests.algo.loss_configs import loss_config
from tests.kernels.test_logprobs import TRUNCATIONS, sampled_targets
from tests.kernels.tolerances import assert_close, compare

F32, BF16 = torch.float32, torch.bfloat16

# log(ratio) = logprob - old_logprob per token, cycled: every value is at least 0.13 away from the
# clip boundaries log(0.8) = -0.223, log(1.2) = 0.182 (log(1.28) = 0.247 with clip-higher) and the
# dual-clip boundary log(3) = 1.10, further than bf16 inputs move a log-prob (at most 0.067 over
# these tests' inputs), so every precision takes the same branch. With advantages of both signs each
# branch occurs: inside the range, clipped above (A > 0) and below (A < 0), and dual-clipped (ratio
# 4.5, A < 0).
LOG_RATIOS = (-0.6, -0.05, 0.05, 0.6, 1.5)
# r = ref_logprob - logprob per token, cycled (7 values: every pairing with LOG_RATIOS occurs), none
# so close to 0 that the KL (~ r^2 / 2) is only rounding noise.
REF_LOG_RATIOS = (0.5, -0.8, 0.3, -0.4, 1.0, -0.25, 0.7)


def cycled(values: tuple[float, ...], n: int, device) -> torch.Tensor:
    """(n,) float32: ``values`` repeated to length n."""
    return torch.tensor(values, device=device).repeat(n // len(values) + 1)[:n]


def hidden_inputs(
    num_tokens: int, hidden: int, vocab: int, seed: int = 0, device: str = "cpu"
) -> dict:
    """hidden (N, H) and lm_head weight (V, H) giving logits of std ~3, targets (N,) including 0 and
    V - 1."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(num_tokens, hidden, generator=gen)  # (N, H)
    w = 3.0 / hidden**0.5 * torch.randn(vocab, hidden, generator=gen)  # (V, H)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)  # (N,)
    targets[0] = vocab - 1
    if num_tokens > 1:
        targets[1] = 0
    return {"hidden": h.to(device), "weight": w.to(device), "targets": targets.to(device)}


def truncated_inputs(base: dict, temperature: float, truncation: Truncation) -> dict:
    """``base`` (hidden_inputs) with targets drawn from the truncated distribution at some
    positions, as a sampler's (tests.kernels.test_logprobs.sampled_targets)."""
    logits = base["hidden"] @ base["weight"].t()
    return {**base, "targets": sampled_targets(logits, base["targets"], temperature, truncation)}


def logprobs_kernel(
    backend: str, temperature: float, chunk_tokens: int, truncation: Truncation = NO_TRUNCATION
):
    def fn(hidden, weight, targets):
        logprob, entropy = kernels.logprobs_from_hidden(
            hidden, weight, targets, temperature, chunk_tokens, backend, truncation
        )
        return {"logprob": logprob, "entropy": entropy}

    return fn


def logprobs_reference(temperature: float, truncation: Truncation = NO_TRUNCATION):
    # full logits in the inputs' dtype, as the model's lm_head makes them
    def fn(hidden, weight, targets):
        logprob, entropy = token_logprobs_and_entropy(
            hidden @ weight.t(), targets, temperature=temperature, truncation=truncation
        )
        return {"logprob": logprob, "entropy": entropy}

    return fn


def compare_logprobs(
    backend: str,
    dtype: torch.dtype,
    num_tokens: int,
    hidden: int,
    vocab: int,
    temperature: float,
    chunk_tokens: int,
    device: str = "cpu",
    seed: int = 0,
    truncation: Truncation = NO_TRUNCATION,
) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    upstream = {
        "logprob": torch.randn(num_tokens, generator=gen).to(device),
        "entropy": torch.randn(num_tokens, generator=gen).to(device),
    }
    inputs = truncated_inputs(
        hidden_inputs(num_tokens, hidden, vocab, seed, device), temperature, truncation
    )
    compare(
        logprobs_kernel(backend, temperature, chunk_tokens, truncation),
        logprobs_reference(temperature, truncation),
        inputs,
        dtype,
        low_precision=("hidden", "weight"),
        differentiable=("hidden", "weight"),
        upstream=upstream,
        what=f"{backend} N={num_tokens} V={vocab} chunk={chunk_tokens} {truncation}",
    )


def loss_inputs(
    base: dict,
    temperature: float,
    has_old: bool,
    has_ref: bool,
    seed: int = 0,
    truncation: Truncation = NO_TRUNCATION,
) -> dict:
    """The per-token loss inputs for ``base`` (hidden_inputs): old log-probs at LOG_RATIOS from the
    float32 log-probs, reference log-probs nearby, advantages of both signs, token weights with some
    zeros."""
    n, device = base["targets"].shape[0], base["hidden"].device
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        logprob = logprobs_reference(temperature, truncation)(**base)["logprob"]  # (N,) float32
    # (N,)
    advantages = torch.randn(n, generator=gen).abs().to(device) * cycled((1.0, -1.0), n, device)
    # (N,) every 4th token weighs 0
    weights = torch.rand(n, generator=gen) * (torch.arange(n) % 4 != 3)
    return {
        **base,
        "advantages": advantages,
        "weights": weights.to(device),
        "old_logprobs": logprob - cycled(LOG_RATIOS, n, device) if has_old else None,
        "ref_logprobs": logprob + cycled(REF_LOG_RATIOS, n, device) if has_ref else None,
    }


def loss_kernel(
    backend: str,
    cfg: LossConfig,
    temperature: float,
    chunk_tokens: int,
    truncation: Truncation = NO_TRUNCATION,
):
    def fn(hidden, weight, targets, advantages, weights, old_logprobs, ref_logprobs):
        out = kernels.policy_loss_from_hidden(
            hidden,
            weight,
            LossInputs(targets, advantages, weights, old_logprobs, ref_logprobs),
            cfg,
            temperature,
            chunk_tokens,
            backend,
            truncation,
        )
        return {
            "loss": out.loss,
            "logprob": out.logprobs,
            "entropy": out.entropy,
            "kl": out.kl,
            "clipped": out.clipped,
        }

    return fn


def loss_reference(
    cfg: LossConfig, temperature: float, reduce: bool = True, truncation: Truncation = NO_TRUNCATION
):
    def fn(hidden, weight, targets, advantages, weights, old_logprobs, ref_logprobs):
        logprob, entropy = token_logprobs_and_entropy(
            hidden @ weight.t(), targets, temperature=temperature, truncation=truncation
        )
        per_token, kl, clipped = token_losses(
            logprob, old_logprobs, advantages, ref_logprobs, entropy, cfg
        )
        weighted = per_token * weights  # (N,)
        return {
            "loss": weighted.sum() if reduce else weighted,
            "logprob": logprob,
            "entropy": entropy,
            "kl": kl,
            "clipped": clipped,
        }

    return fn


def tuned_loss_kernel(tuning, cfg: LossConfig, temperature: float, chunk_tokens: int):
    """The Triton function with a FusedTuning (row launch, weight-gradient sum), as benchmarks'
    --sweep runs it."""
    from grpo_ds.kernels.fused_linear import PolicyLossFromHidden

    def fn(hidden, weight, targets, advantages, weights, old_logprobs, ref_logprobs):
        loss, stats = PolicyLossFromHidden.apply(
            hidden.contiguous(),
            weight,
            targets,
            old_logprobs,
            ref_logprobs,
            advantages,
            weights,
            cfg,
            temperature,
            chunk_tokens,
            NO_TRUNCATION,
            tuning,
        )
        return {
            "loss": loss,
            "logprob": stats[0],
            "entropy": stats[1],
            "kl": stats[2],
            "clipped": stats[3],
        }

    return fn


def compare_policy_loss(
    backend: str,
    dtype: torch.dtype,
    cfg: LossConfig,
    has_old: bool,
    has_ref: bool,
    num_tokens: int,
    hidden: int,
    vocab: int,
    temperature: float = 1.0,
    chunk_tokens: int = 4,
    device: str = "cpu",
    seed: int = 0,
    tuning=None,
    truncation: Truncation = NO_TRUNCATION,
) -> dict:
    # Upstream gradient 3 (not 1): the Triton backend computes its gradients in the forward and
    # scales them in the backward. The loss sums terms of both signs (advantages of both signs), so
    # its error is measured against the sum of their magnitudes, sum_t |w_t l_t|, not against the
    # (partly cancelled) sum.
    base = truncated_inputs(
        hidden_inputs(num_tokens, hidden, vocab, seed, device), temperature, truncation
    )
    inputs = loss_inputs(base, temperature, has_old, has_ref, seed, truncation)
    with torch.no_grad():
        terms = loss_reference(cfg, temperature, False, truncation)(**inputs)["loss"]  # (N,)
    kernel = (
        loss_kernel(backend, cfg, temperature, chunk_tokens, truncation)
        if tuning is None
        else tuned_loss_kernel(tuning, cfg, temperature, chunk_tokens)
    )
    return compare(
        kernel,
        loss_reference(cfg, temperature, truncation=truncation),
        inputs,
        dtype,
        low_precision=("hidden", "weight"),
        differentiable=("hidden", "weight"),
        upstream={"loss": torch.tensor(3.0, device=device)},
        what=f"{backend} {cfg} old={has_old} ref={has_ref} V={vocab} {truncation}",
        scales={"loss": terms.abs().sum().item()},
    )


# Every LossConfig variant, and each with and without old / reference log-probs (None: on-policy,
# ratio exactly 1 / no reference model, KL 0): the 12 combinations of KL estimator x dual clip x
# entropy bonus, with the four (old, ref) presences rotated so each estimator meets all four and
# each (dual clip, entropy) pair meets three. clip_high 0.28: DAPO's asymmetric clip.
PRESENCE = list(itertools.product((True, False), (True, False)))  # (has_old, has_ref)
CONFIGS = [
    (
        loss_config(clip_high=0.28, dual_clip=dual, kl_coef=0.1, kl_estimator=kl, entropy_coef=ent),
        *PRESENCE[(i + i // 4) % 4],
    )
    for i, (kl, dual, ent) in enumerate(
        itertools.product(("k1", "k2", "k3"), (None, 3.0), (0.0, 0.01))
    )
]
ALL_TERMS = loss_config(
    clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01
)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("vocab", "temperature", "chunk_tokens"), [(103, 1.0, 4), (1000, 0.7, 16), (5003, 1.3, 3)]
)
def test_logprobs_from_hidden(backend, dtype, vocab, temperature, chunk_tokens):
    # 10 tokens: chunk 4 and 3 leave a partial last chunk, 16 is a single chunk larger than N.
    compare_logprobs(
        backend,
        dtype,
        num_tokens=10,
        hidden=32,
        vocab=vocab,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("vocab", "temperature", "truncation"), TRUNCATIONS, ids=str)
def test_truncated_logprobs_from_hidden(backend, dtype, vocab, temperature, truncation):
    compare_logprobs(
        backend,
        dtype,
        num_tokens=10,
        hidden=32,
        vocab=vocab,
        temperature=temperature,
        chunk_tokens=4,
        truncation=truncation,
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("vocab", "temperature", "truncation"), TRUNCATIONS[1:3], ids=str)
def test_truncated_policy_loss(backend, dtype, vocab, temperature, truncation):
    compare_policy_loss(
        backend,
        dtype,
        ALL_TERMS,
        True,
        True,
        num_tokens=10,
        hidden=32,
        vocab=vocab,
        temperature=temperature,
        chunk_tokens=3,
        truncation=truncation,
    )


def test_logprobs_large_vocabulary(backend):
    compare_logprobs(
        backend, F32, num_tokens=4, hidden=64, vocab=32000, temperature=1.0, chunk_tokens=3
    )


def test_policy_loss_every_config(backend):
    for cfg, has_old, has_ref in CONFIGS:
        compare_policy_loss(
            backend, F32, cfg, has_old, has_ref, num_tokens=10, hidden=16, vocab=103
        )


@pytest.mark.parametrize(
    ("vocab", "cfg", "has_old", "has_ref"),
    [
        (1000, ALL_TERMS, True, True),  # every term of the loss
        # on-policy, no dual clip, no entropy bonus
        (5003, loss_config(kl_coef=0.1, kl_estimator="k2"), False, True),
    ],
)
def test_policy_loss_bf16(backend, vocab, cfg, has_old, has_ref):
    compare_policy_loss(
        backend, BF16, cfg, has_old, has_ref, num_tokens=10, hidden=32, vocab=vocab, temperature=0.8
    )


@pytest.mark.parametrize(
    ("block_v", "num_warps", "weight_grad_sum", "dtype"),
    [
        # a block much smaller than the vocabulary: the online log-sum-exp runs 16 steps a row
        (64, 8, "fp32", F32),
        # one block wider than the vocabulary; the weight gradient summed in bf16
        (2048, 2, "model-dtype", BF16),
        (128, None, "model-dtype", F32),  # float32 inputs: "model-dtype" is the float32 sum
    ],
)
def test_policy_loss_tuning_keeps_the_result(
    triton_backend, block_v, num_warps, weight_grad_sum, dtype
):
    """The knobs benchmarks/bench_fused_linear.py --sweep turns (FusedTuning) change the launch, not
    the math."""
    from grpo_ds.kernels.fused_linear import FusedTuning
    from grpo_ds.kernels.token_math import Launch

    tuning = FusedTuning(Launch(block_v, num_warps), weight_grad_sum)
    compare_policy_loss(
        triton_backend,
        dtype,
        ALL_TERMS,
        True,
        True,
        num_tokens=10,
        hidden=32,
        vocab=1000,
        temperature=0.8,
        chunk_tokens=3,
        tuning=tuning,
    )


def test_tuning_refuses_what_cannot_launch():
    from grpo_ds.kernels.fused_linear import FusedTuning
    from grpo_ds.kernels.token_math import Launch

    with pytest.raises(ValueError, match="power of two"):
        Launch(block_v=1000)
    with pytest.raises(ValueError, match="num_warps"):
        Launch(num_warps=3)
    with pytest.raises(ValueError, match="weight_grad_sum"):
        FusedTuning(weight_grad_sum="fp16")
    assert Launch().options(151_936) == {"BLOCK_V": 4096}  # the default: Triton's own num_warps
    assert Launch(8192, 16).options(151_936) == {"BLOCK_V": 8192, "num_warps": 16}


def test_policy_loss_single_token(backend):
    compare_policy_loss(
        backend, F32, ALL_TERMS, True, True, num_tokens=1, hidden=16, vocab=103, chunk_tokens=1
    )


def test_policy_loss_branches_occur():
    # The inputs really exercise the branches: tokens inside the clip range, ratio-clipped, and
    # dual-clipped.
    inputs = loss_inputs(hidden_inputs(10, 16, 103), 1.0, True, True)
    no_dual = loss_reference(loss_config(), 1.0)(**inputs)["clipped"]
    dual = loss_reference(loss_config(dual_clip=3.0), 1.0)(**inputs)["clipped"]
    assert 0 < int(no_dual.sum()) < int(dual.sum()) < 10


def test_upstream_gradient_scales(backend):
    # (3 * loss).backward() gives 3 times the gradients of loss.backward(), to the rounding of one
    # product.
    inputs = loss_inputs(hidden_inputs(7, 16, 1000), 1.0, True, True)

    def grads(factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = inputs["hidden"].clone().requires_grad_(True)
        weight = inputs["weight"].clone().requires_grad_(True)
        loss_inputs_ = LossInputs(
            inputs["targets"],
            inputs["advantages"],
            inputs["weights"],
            inputs["old_logprobs"],
            inputs["ref_logprobs"],
        )
        out = kernels.policy_loss_from_hidden(
            hidden, weight, loss_inputs_, ALL_TERMS, 1.0, 3, backend
        )
        (out.loss if factor == 1 else factor * out.loss).backward()
        return hidden.grad, weight.grad

    for name, once, thrice in zip(("grad_hidden", "grad_weight"), grads(1), grads(3), strict=True):
        assert_close(thrice, 3 * once, F32, name)
        assert not torch.allclose(thrice, once)


def test_no_grad_computes_no_gradients_in_the_forward(triton_backend, monkeypatch):
    """The Triton path computes the gradients in its forward, where autograd says the inputs need
    them, which it still says under no_grad: policy_loss_from_hidden detaches the inputs there, so a
    forward alone (an evaluation pass) runs one matmul a chunk instead of three."""
    from grpo_ds.kernels import fused_linear

    calls = []
    real = fused_linear.accumulate_weight_grad
    monkeypatch.setattr(
        fused_linear, "accumulate_weight_grad", lambda *a: calls.append(1) or real(*a)
    )
    inputs = loss_inputs(hidden_inputs(7, 16, 1000), 1.0, True, True)
    inputs["hidden"].requires_grad_(True)
    inputs["weight"].requires_grad_(True)
    with torch.no_grad():
        loss_kernel(triton_backend, ALL_TERMS, 1.0, 3)(**inputs)
    assert calls == []
    loss_kernel(triton_backend, ALL_TERMS, 1.0, 3)(**inputs)["loss"].backward()
    assert len(calls) == 3  # 7 tokens in chunks of 3


def test_no_grad_still_returns_the_loss(backend):
    # Under no_grad (e.g. an evaluation pass) the loss and statistics are the same; nothing is
    # differentiable.
    inputs = loss_inputs(hidden_inputs(7, 16, 1000), 1.0, True, True)
    inputs["hidden"].requires_grad_(True)
    inputs["weight"].requires_grad_(True)
    with_grad = loss_kernel(backend, ALL_TERMS, 1.0, 3)(**inputs)
    with torch.no_grad():
        without = loss_kernel(backend, ALL_TERMS, 1.0, 3)(**inputs)
    assert not without["loss"].requires_grad
    for key, value in with_grad.items():
        assert torch.equal(without[key], value.detach()), key


def test_loss_inputs_shapes_checked(backend):
    inputs = loss_inputs(hidden_inputs(4, 16, 103), 1.0, True, True)
    bad = LossInputs(inputs["targets"], inputs["advantages"][:3], inputs["weights"])
    with pytest.raises(ValueError, match="advantages"):
        kernels.policy_loss_from_hidden(
            inputs["hidden"], inputs["weight"], bad, loss_config(), backend=backend
        )
