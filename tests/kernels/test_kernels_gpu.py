"""The comparisons of tests/kernels natively on a CUDA GPU, at training sizes: 512 tokens, the
lm_head of Qwen2.5-0.5B (H = 896, V = 151936) and a 32000-token vocabulary; same references, same
tolerance tables (tests/kernels/tolerances.py). Skipped without a GPU.

bf16 logprobs_from_hidden / policy_loss_from_hidden run as one chunk of all 512 tokens: the kernel's
(chunk, H) @ (H, V) GEMM is then the very GEMM of the reference, whereas a GEMM of another shape may
pick a different cuBLAS algorithm and round some bf16 logits the other way (one bf16 ulp of a logit
of ~10 is 0.06). The fp32 runs use chunks of 200 tokens (a partial last chunk).
"""

import pytest
import torch

from grpo_ds.config.software import triton_problem
from tests.algo.loss_configs import loss_config
from tests.kernels.test_advantages import compare_advantages
from tests.kernels.test_fused_linear import ALL_TERMS, compare_logprobs, compare_policy_loss
from tests.kernels.test_logprobs import compare_logits
from tests.kernels.test_policy_loss import compare_masked

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

F32, BF16 = torch.float32, torch.bfloat16
N, H = 512, 896
VOCABS = [32000, 151936]


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> str:
    if request.param == "triton":
        pytest.importorskip("triton")
        problem = triton_problem("cuda")
        if problem is not None:
            pytest.skip(problem)
    return request.param


def _chunk(dtype: torch.dtype) -> int:
    return N if dtype == BF16 else 200


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_logits(backend, dtype, vocab):
    # 600 rows of which 512 are scored, as the response positions of a padded batch.
    compare_logits(
        backend,
        dtype,
        num_rows=600,
        num_scored=N,
        vocab=vocab,
        temperature=0.9,
        chunk_tokens=200,
        device="cuda",
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_logprobs_from_hidden(backend, dtype, vocab):
    compare_logprobs(
        backend,
        dtype,
        num_tokens=N,
        hidden=H,
        vocab=vocab,
        temperature=1.0,
        chunk_tokens=_chunk(dtype),
        device="cuda",
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("cfg", "has_old", "has_ref"),
    [
        (ALL_TERMS, True, True),
        (loss_config(kl_coef=0.1, kl_estimator="k1"), False, True),
        (loss_config(), False, False),
    ],
    ids=["all-terms", "on-policy-k1", "plain"],
)
def test_policy_loss_from_hidden(backend, dtype, cfg, has_old, has_ref):
    compare_policy_loss(
        backend,
        dtype,
        cfg,
        has_old,
        has_ref,
        num_tokens=N,
        hidden=H,
        vocab=151936,
        temperature=0.8,
        chunk_tokens=_chunk(dtype),
        device="cuda",
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_masked_policy_loss(backend, dtype):
    compare_masked(
        backend,
        dtype,
        ALL_TERMS,
        True,
        True,
        has_entropy=True,
        num_seqs=64,
        width=2048,
        device="cuda",
    )
    compare_masked(
        backend,
        dtype,
        loss_config(kl_coef=0.1, kl_estimator="k2"),
        False,
        True,
        has_entropy=False,
        num_seqs=64,
        width=2048,
        device="cuda",
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size", [1, 16])
def test_advantages(backend, dtype, group_size):
    compare_advantages(backend, dtype, num_groups=512, group_size=group_size, device="cuda")


@pytest.mark.parametrize("weight_grad_sum", ["fp32-gemm", "model-dtype"])
def test_policy_loss_from_hidden_weight_grad_sums(weight_grad_sum):
    """The weight-gradient sums benchmarks/bench_fused_linear.py --sweep compares (FusedTuning), on
    the GPU: the matmul's own float32 accumulation (torch.addmm's out_dtype, CUDA only) and the bf16
    sum."""
    from grpo_ds.kernels.fused_linear import FusedTuning

    problem = triton_problem("cuda")
    if problem is not None:
        pytest.skip(problem)
    compare_policy_loss(
        "triton",
        torch.bfloat16,
        ALL_TERMS,
        True,
        True,
        num_tokens=512,
        hidden=256,
        vocab=32000,
        temperature=0.8,
        chunk_tokens=_chunk(torch.bfloat16),
        device="cuda",
        tuning=FusedTuning(weight_grad_sum=weight_grad_sum),
    )
