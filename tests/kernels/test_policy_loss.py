"""grpo_ds.kernels.masked_policy_loss (Triton: grpo_ds/kernels/policy_loss.py; torch:
kernels/__init__.py) against grpo_ds.algo.policy_loss.token_losses summed per sequence, on the sums
and the gradients of the log-probs and the entropy."""

import pytest
import torch

from grpo_ds import kernels
from grpo_ds.algo.policy_loss import LossConfig, token_losses
from tests.algo.loss_configs import loss_config
from tests.kernels.test_fused_linear import CONFIGS, LOG_RATIOS, REF_LOG_RATIOS, cycled
from tests.kernels.tolerances import assert_close, compare, evaluate

F32, BF16 = torch.float32, torch.bfloat16
SUMS = ("seq_loss", "seq_kl", "seq_entropy", "seq_clipped", "seq_tokens")


def masked_inputs(
    num_seqs: int,
    width: int,
    has_old: bool,
    has_ref: bool,
    has_entropy: bool,
    seed: int = 0,
    device: str = "cpu",
) -> dict:
    """A (B, T) batch (B >= 5): row 0 fully masked, row 1 a length-1 response, row 2 full, the
    others a prefix with a hole (a multi-turn observation). Old log-probs at LOG_RATIOS (see
    test_fused_linear), advantages of both signs, reference log-probs at REF_LOG_RATIOS. Masked-out
    positions hold ordinary values here (see test_masked_positions_never_leak)."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = -2.0 * torch.randn(num_seqs, width, generator=gen).abs()  # (B, T)
    size = (num_seqs, width)
    mask = torch.zeros(num_seqs, width)  # (B, T)
    mask[1, 0] = 1.0
    mask[2] = 1.0
    for row in range(3, num_seqs):
        mask[row, : int(torch.randint(2, width + 1, (1,), generator=gen))] = 1.0
        mask[row, 1] = 0.0
    inputs = {
        "logprobs": logprobs,
        "old_logprobs": logprobs - cycled(LOG_RATIOS, logprobs.numel(), "cpu").view(size)
        if has_old
        else None,
        "ref_logprobs": logprobs + cycled(REF_LOG_RATIOS, logprobs.numel(), "cpu").view(size)
        if has_ref
        else None,
        "entropy": 3.0 * torch.rand(size, generator=gen) if has_entropy else None,
        "advantages": torch.randn(num_seqs, generator=gen).abs()
        * cycled((1.0, -1.0), num_seqs, "cpu"),
        "mask": mask,
    }
    return {k: None if v is None else v.to(device) for k, v in inputs.items()}


def masked_kernel(backend: str, cfg: LossConfig):
    def fn(logprobs, old_logprobs, ref_logprobs, entropy, advantages, mask):
        sums = kernels.masked_policy_loss(
            logprobs, advantages, mask, cfg, old_logprobs, ref_logprobs, entropy, backend
        )
        return dict(zip(SUMS, sums, strict=True))

    return fn


def masked_reference(cfg: LossConfig):
    def fn(logprobs, old_logprobs, ref_logprobs, entropy, advantages, mask):
        keep = mask != 0  # (B, T)
        per_token, kl, clipped = token_losses(
            logprobs,
            old_logprobs,
            advantages[:, None].expand_as(logprobs),
            ref_logprobs,
            entropy,
            cfg,
        )
        ent = torch.zeros_like(logprobs) if entropy is None else entropy

        # per-token values in the inputs' dtype, sums in fp32
        def row_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.where(keep, values.float(), 0.0).sum(dim=1)  # (B,)

        return {
            "seq_loss": row_sum(per_token * mask),
            "seq_kl": row_sum(kl),
            "seq_entropy": row_sum(ent),
            "seq_clipped": row_sum(clipped),
            "seq_tokens": row_sum(torch.ones_like(logprobs)),
        }

    return fn


def compare_masked(
    backend: str,
    dtype: torch.dtype,
    cfg: LossConfig,
    has_old: bool,
    has_ref: bool,
    has_entropy: bool,
    num_seqs: int = 5,
    width: int = 7,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    inputs = masked_inputs(num_seqs, width, has_old, has_ref, has_entropy, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    got = compare(
        masked_kernel(backend, cfg),
        masked_reference(cfg),
        inputs,
        dtype,
        low_precision=("logprobs", "old_logprobs", "ref_logprobs", "entropy"),
        differentiable=("logprobs", "entropy") if has_entropy else ("logprobs",),
        upstream={"seq_loss": torch.randn(num_seqs, generator=gen).to(device)},
        what=f"{backend} {cfg} old={has_old} ref={has_ref} entropy={has_entropy}",
    )
    # The fully masked row: exactly zero sums and gradients.
    for key in SUMS:
        assert got[key][0].item() == 0.0, key
    for key in ("grad_logprobs", "grad_entropy") if has_entropy else ("grad_logprobs",):
        assert torch.equal(got[key][0], torch.zeros_like(got[key][0])), key
    assert got["seq_tokens"][1].item() == 1.0  # the length-1 response
    return got


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_every_config(backend, dtype):
    # The entropy input goes with the entropy bonus (cfg.entropy_coef > 0) in every other
    # configuration.
    for i, (cfg, has_old, has_ref) in enumerate(CONFIGS):
        compare_masked(backend, dtype, cfg, has_old, has_ref, has_entropy=i % 2 == 1, seed=i)


def test_several_blocks_per_row(backend):
    # T = 1100 > 1024, the kernel's cap on its block of positions: each row is read in two blocks.
    cfg, has_old, has_ref = CONFIGS[7]
    compare_masked(backend, F32, cfg, has_old, has_ref, has_entropy=True, num_seqs=5, width=1100)


def test_weighted_mask(backend):
    # mask holds weights m_t >= 0: the loss sum is sum_t m_t l_t (and its gradient m_t dl_t), the
    # other sums count the tokens with m_t != 0.
    cfg, has_old, has_ref = CONFIGS[7]
    inputs = masked_inputs(5, 7, has_old, has_ref, True)
    inputs["mask"] = (
        inputs["mask"] * torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) * 2
    )
    upstream = {"seq_loss": torch.randn(5)}
    got = evaluate(masked_kernel(backend, cfg), inputs, ("logprobs", "entropy"), upstream)
    expected = evaluate(masked_reference(cfg), inputs, ("logprobs", "entropy"), upstream)
    for key, value in expected.items():
        assert_close(got[key], value, F32, key)


def test_bool_mask(backend):
    cfg, has_old, has_ref = CONFIGS[7]
    inputs = masked_inputs(5, 7, has_old, has_ref, True)
    float_mask = masked_kernel(backend, cfg)(**inputs)
    bool_mask = masked_kernel(backend, cfg)(**{**inputs, "mask": inputs["mask"].bool()})
    for key in SUMS:
        assert torch.equal(bool_mask[key], float_mask[key]), key


def test_masked_positions_never_leak(backend):
    # Padding may hold anything: NaN log-probs, -inf old log-probs, inf entropy. The sums and the
    # gradients must equal those of the same batch with finite padding, and masked positions get
    # exactly zero gradient.
    cfg, has_old, has_ref = CONFIGS[7]  # k2, dual clip, entropy bonus, old and reference log-probs
    clean = masked_inputs(5, 7, has_old, has_ref, True)
    out = clean["mask"] == 0
    dirty = dict(clean)
    for key, value in (
        ("logprobs", float("nan")),
        ("old_logprobs", float("-inf")),
        ("ref_logprobs", float("inf")),
        ("entropy", float("inf")),
    ):
        dirty[key] = clean[key].masked_fill(out, value)
    upstream = {"seq_loss": torch.randn(5)}
    expected = evaluate(masked_kernel(backend, cfg), clean, ("logprobs", "entropy"), upstream)
    got = evaluate(masked_kernel(backend, cfg), dirty, ("logprobs", "entropy"), upstream)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    for key in ("grad_logprobs", "grad_entropy"):
        assert torch.equal(got[key][out], torch.zeros(int(out.sum()))), key


def test_empty_batch(backend):
    empty = torch.zeros(0, 7)
    sums = kernels.masked_policy_loss(empty, torch.zeros(0), empty, loss_config(), backend=backend)
    assert all(value.shape == (0,) for value in sums)
