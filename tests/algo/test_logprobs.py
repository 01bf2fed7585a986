import math

import pytest
import torch

from grpo_ds.algo.logprobs import token_logprobs_and_entropy

# The reference is computed in float64 straight from the definitions; the function returns float32.
# With a vocabulary of a few dozen entries the float32 result is within a few ulp of the float64
# one, so the float32 defaults of assert_close (rtol 1.3e-6, atol 1e-5) apply after casting the
# reference to float32.

N, V = 7, 33


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    scaled = logits.to(torch.float64) / temperature  # (N, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (N, V)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
    entropy = -(logp.exp() * logp).sum(dim=-1)  # (N,)
    return logprobs, entropy


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # (N, V), spread so rows are not near-uniform
    logits = (3.0 * torch.randn(N, V, generator=gen)).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)  # (N,)
    return logits, targets


@pytest.mark.parametrize("chunk_tokens", [1, 2, 3, N, 1024])
def test_matches_log_softmax_and_entropy(chunk_tokens):
    logits, targets = _inputs()
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, chunk_tokens=chunk_tokens)
    ref_lp, ref_ent = _reference(logits, targets)
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert logprobs.shape == entropy.shape == (N,)
    torch.testing.assert_close(logprobs, ref_lp.float())
    torch.testing.assert_close(entropy, ref_ent.float())


def test_uniform_and_one_hot_extremes():
    # Uniform logits: logprob = -ln V, entropy = ln V. A dominant logit: logprob ~ 0, entropy ~ 0.
    logits = torch.zeros(2, V)
    logits[1, 5] = 100.0
    logprobs, entropy = token_logprobs_and_entropy(logits, torch.tensor([3, 5]), chunk_tokens=1)
    torch.testing.assert_close(logprobs, torch.tensor([-math.log(V), 0.0]))
    torch.testing.assert_close(entropy, torch.tensor([math.log(V), 0.0]))


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature(temperature):
    logits, targets = _inputs(seed=1)
    logprobs, entropy = token_logprobs_and_entropy(
        logits, targets, chunk_tokens=3, temperature=temperature
    )
    ref_lp, ref_ent = _reference(logits, targets, temperature)
    torch.testing.assert_close(logprobs, ref_lp.float())
    torch.testing.assert_close(entropy, ref_ent.float())
    # And temperature really changes the answer (guards against it being ignored).
    plain_lp, _ = _reference(logits, targets)
    assert not torch.allclose(logprobs, plain_lp.float(), atol=1e-3)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
def test_gradient_matches_unchunked_reference(chunk_tokens):
    logits, targets = _inputs(seed=2)
    gen = torch.Generator().manual_seed(3)
    # (N,), (N,) upstream grads
    w_lp, w_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)

    x = logits.clone().requires_grad_(True)  # (N, V) float32
    logprobs, entropy = token_logprobs_and_entropy(
        x, targets, chunk_tokens=chunk_tokens, temperature=0.8
    )
    ((w_lp * logprobs).sum() + (w_ent * entropy).sum()).backward()

    x_ref = logits.to(torch.float64).requires_grad_(True)  # (N, V) float64, unchunked
    ref_lp, ref_ent = _reference(x_ref, targets, temperature=0.8)
    ((w_lp.double() * ref_lp).sum() + (w_ent.double() * ref_ent).sum()).backward()

    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_ref.grad.float())


def test_bf16_input_gives_float32_output_and_bf16_grad():
    logits, targets = _inputs(seed=4, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)  # (N, V) bf16
    logprobs, entropy = token_logprobs_and_entropy(x, targets, chunk_tokens=2)
    assert logprobs.dtype == entropy.dtype == torch.float32
    # Upcasting bf16 to float64 is exact, so if the math really runs in float32 (not bf16) the
    # result agrees with the float64 reference on the same bf16 values to float32 tolerance; bf16
    # math would be off ~1e-2.
    ref_lp, ref_ent = _reference(logits, targets)
    torch.testing.assert_close(logprobs, ref_lp.float())
    torch.testing.assert_close(entropy, ref_ent.float())
    (logprobs.sum() + entropy.sum()).backward()
    assert x.grad.dtype == torch.bfloat16


def test_no_grad_and_empty():
    logits, targets = _inputs()
    with torch.no_grad():
        logprobs, entropy = token_logprobs_and_entropy(
            logits.requires_grad_(True), targets, chunk_tokens=2
        )
    assert not logprobs.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(logprobs, _reference(logits.detach(), targets)[0].float())
    lp, ent = token_logprobs_and_entropy(torch.zeros(0, V), torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,) and lp.dtype == torch.float32


def test_bad_arguments_raise():
    logits, targets = _inputs()
    with pytest.raises(ValueError, match="target_ids"):
        token_logprobs_and_entropy(logits, targets[:-1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs_and_entropy(logits, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match=r"\(N, V\)"):
        token_logprobs_and_entropy(logits.unsqueeze(0), targets)


def test_backward_keeps_no_float32_copy_of_the_logits():
    # Everything autograd saves for backward, other than views of the logits themselves, must stay
    # far below one float32 copy of (N, V): each chunk's float32 temporaries are recomputed in
    # backward, not kept. (Without the per-chunk recomputation the saved tensors exceed N * V *
    # 4 bytes.)
    n, v = 64, 2000
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)  # (n, v)
    targets = torch.randint(0, v, (n,))  # (n,)
    saved_bytes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            saved_bytes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = token_logprobs_and_entropy(logits, targets, chunk_tokens=8)
    assert sum(saved_bytes) < n * v * 4 / 10
    (logprobs.sum() + entropy.sum()).backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
