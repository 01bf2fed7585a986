"""vLLM on a GPU: after a weight sync through the bucketed exporter, vLLM's sampled log-probs match
the trainer's.

Needs vLLM (grpo_ds[vllm]) and a CUDA GPU; skipped cleanly otherwise (vLLM cannot be installed on
the CPU machines). One process, world size 1: the trainer is a ZeRO-3 engine, vLLM is colocated on
the same GPU.
"""

import copy

import pytest
import torch

pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("vLLM needs a CUDA GPU", allow_module_level=True)

from grpo_ds.config.deepspeed import resolve_deepspeed_config  # noqa: E402
from grpo_ds.config.loading import load_recipe  # noqa: E402
from grpo_ds.distributed.ranks import init_distributed  # noqa: E402
from grpo_ds.model.engine import create_reference_engine
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from grpo_ds.model.weight_gather import gathered_named_parameters  # noqa: E402
from grpo_ds.rollout.base import SamplingParams  # noqa: E402
from grpo_ds.rollout.vllm import VLLMRolloutEngine, VLLMSettings  # noqa: E402
from grpo_ds.rollout.vllm_checks import require_vllm  # noqa: E402

HIDDEN, LAYERS, HEADS = 256, 2, 4  # head dim 64: every vLLM attention backend takes it


def _model(vocab: int, seed: int) -> torch.nn.Module:
    """A random tiny Llama in bf16 whose output distribution is peaked (lm_head scaled), so that two
    seeds give clearly different log-probs while bf16 rounding stays far smaller."""
    model = build_tiny_model(
        vocab, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, seed=seed
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.to(torch.bfloat16)


def _trainer_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """log softmax(logits / T) of the response tokens (the trainer's math; ``model`` holds the bf16
    weights in fp32)."""
    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
    return torch.log_softmax(logits / temperature, -1).gather(
        -1, torch.tensor(response, device="cuda")[:, None]
    )[:, 0]


def _max_and_mean_gap(
    reference: torch.nn.Module, rollouts, temperature: float
) -> tuple[float, float]:
    gaps = torch.cat(
        [
            (
                torch.tensor(lp, device="cuda") - _trainer_logprobs(reference, p, r, temperature)
            ).abs()
            for p, r, lp in zip(
                rollouts.prompt_ids, rollouts.response_ids, rollouts.sampler_logprobs, strict=True
            )
        ]
    )
    return gaps.max().item(), gaps.mean().item()


def test_vllm_logprobs_match_the_trainer_after_a_weight_sync():
    require_vllm()
    dist = init_distributed()
    assert dist.world_size == 1
    tok = build_tiny_tokenizer()
    trained = _model(len(tok), seed=0)  # the trainer's policy
    # unsharded, the same weights in fp32, for the reference
    reference = copy.deepcopy(trained).float().cuda()
    settings = VLLMSettings(
        model_path="builtin:tiny",
        dtype="bfloat16",
        tensor_parallel_size=1,
        gpu_memory_utilization=0.3,
        max_model_len=128,
        sleep_mode=True,
        seed=0,
        trust_remote_code=False,
    )
    # vLLM starts from other weights
    engine = VLLMRolloutEngine(settings, _model(len(tok), seed=1), tok)
    ds_config = resolve_deepspeed_config(
        load_recipe(
            {
                "model": {"dtype": "bfloat16"},
                "deepspeed": {
                    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}
                },
            }
        ),
        1,
        "cuda",
    )
    zero3 = create_reference_engine(trained, ds_config)  # ZeRO-3 partitioned, as in training
    prompts = [tok.encode(text) for text in ("12+30=", "7*6=", "hello", "(1+2)*3=")]
    temperature = 1.0
    sampling = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5)

    before = engine.generate(prompts, 4, sampling)
    stale_max, stale_mean = _max_and_mean_gap(reference, before, temperature)
    assert stale_mean > 0.5, "the test cannot tell synced from stale weights"

    count = engine.update_weights(gathered_named_parameters(zero3.module, bucket_bytes=2**20))
    assert count == len(list(reference.parameters()))
    after = engine.generate(prompts, 4, sampling)
    assert len(after) == 16 and after.prompt_ids == [p for p in prompts for _ in range(4)]
    for ids, reason in zip(after.response_ids, after.finish_reason, strict=True):
        assert (reason == "stop") == (ids[-1] == tok.eos_token_id) and len(ids) <= 24
    worst, mean = _max_and_mean_gap(reference, after, temperature)
    # the same bf16 weights; vLLM's kernels and bf16 activations against an fp32 forward: rounding
    # of logits of magnitude ~10 at bf16's 2^-8 relative precision, far below the stale gap (sleep
    # mode on: the sync lands in weights woken from sleep, the generation in a woken KV cache)
    assert mean < 0.05 and worst < 0.5, (mean, worst, stale_mean, stale_max)
    for name, param in engine.model.named_parameters():  # the CPU policy copy the driver saves
        torch.testing.assert_close(
            param, dict(reference.named_parameters())[name].cpu().bfloat16(), rtol=0, atol=0
        )
    again = engine.generate(prompts, 4, sampling)
    # seeded requests: the same step samples the same
    assert again.response_ids == after.response_ids
