"""The micro-batch layouts (grpo_ds/step/micro_batch.py): packed and padded rows give the same
per-token numbers, and a packed forward needs use_cache=False."""

import pytest
import torch

from grpo_ds.model.policy import packing_problem
from grpo_ds.model.tiny import build_tiny_model
from grpo_ds.rollout.base import Rollouts
from grpo_ds.step.loss import LossSettings, token_logprobs
from grpo_ds.step.micro_batch import MicroBatch, collate, shard_sequences
from tests.algo.loss_configs import loss_config
from tests.scripts.one_step import fixed_rollouts

LOSS = loss_config()  # the recipe's defaults
SETTINGS = LossSettings(LOSS, temperature=1.0, backend="torch", chunk_tokens=16, fused_lm_head=True)


def _model(attn: str):
    model = build_tiny_model(64, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval()
    model.set_attn_implementation(attn)
    return model


def _alone(model, rollouts: Rollouts, ids: list[int]) -> torch.Tensor:
    """Each sequence's log-probs from a forward of that sequence alone (no padding, no
    neighbours)."""
    return torch.cat(
        [
            token_logprobs(
                model, collate(rollouts, [i], 0, torch.device("cpu"), packed=False), SETTINGS
            )
            for i in ids
        ]
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fused", [True, False])
def test_packed_and_padded_layouts_score_every_token_as_each_sequence_alone(attn, fused):
    rollouts, _ = fixed_rollouts()
    ids = [4, 0, 7, 2, 8]  # lengths differ: the padded rows hold padding, the packed row none
    model = _model(attn)
    settings = LossSettings(LOSS, 1.0, "torch", 16, fused)
    alone = _alone(model, rollouts, ids)
    for packed in (True, False):
        mb = collate(rollouts, ids, 0, torch.device("cpu"), packed=packed)
        torch.testing.assert_close(token_logprobs(model, mb, settings), alone, rtol=0, atol=2e-6)
    # lengths 10, 7, 7, 7, 5 in rows of 10: no two share a row, so packing would only add the
    # block-diagonal mask and the micro-batch takes the padded layout (the packed rows: the next
    # test)
    unshared = collate(rollouts, ids, 0, torch.device("cpu"))
    assert unshared.position_ids is None and unshared.attention_mask.shape == (len(ids), 10)
    one_row = collate(rollouts, ids, 0, torch.device("cpu"), one_row=True)
    # flash attention's layout: no padding at all
    assert one_row.input_ids.shape == (1, one_row.sequence_tokens)
    torch.testing.assert_close(token_logprobs(model, one_row, settings), alone, rtol=0, atol=2e-6)


def test_a_packed_forward_with_the_kv_cache_on_attends_across_sequences(monkeypatch):
    """The regression test for use_cache=False: with the cache on, transformers does not look for
    packed sequences and every token attends to the sequences before it in the row."""
    rollouts, _ = fixed_rollouts()
    ids = [4, 0, 7]
    model = _model("sdpa")
    # the model's own default: the flag must come from the micro-batch
    assert model.config.use_cache
    # all three sequences in one row
    mb = collate(rollouts, ids, 0, torch.device("cpu"), one_row=True)
    assert mb.model_inputs()["use_cache"] is False
    alone = _alone(model, rollouts, ids)
    real = MicroBatch.model_inputs
    monkeypatch.setattr(MicroBatch, "model_inputs", lambda self: {**real(self), "use_cache": True})
    leaked = token_logprobs(model, mb, SETTINGS)
    first = len(rollouts.response_ids[ids[0]])
    # the first sequence has no past
    torch.testing.assert_close(leaked[:first], alone[:first], rtol=0, atol=2e-6)
    assert (leaked[first:] - alone[first:]).abs().max() > 1e-2  # the others see their neighbours


def test_the_packing_probe_accepts_transformers_models_and_refuses_one_that_ignores_position_ids():
    model = _model("sdpa")
    assert packing_problem(model) is None

    class Unpacked(torch.nn.Module):  # attends over the whole row whatever the position ids say
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    assert "attends across packed sequences" in packing_problem(Unpacked(model))


def test_rows_for_eager_and_sdpa_hold_whole_sequences_and_flash_gets_one_row():
    rollouts, _ = fixed_rollouts(24, seed=3)  # lengths 4 to 18: short ones share rows with others
    ids = list(range(24))
    lengths = [len(rollouts.prompt_ids[i]) + len(rollouts.response_ids[i]) for i in ids]
    mb = collate(rollouts, ids, 0, torch.device("cpu"))
    rows, width = mb.input_ids.shape
    # fewer rows than padded
    assert width == max(lengths) and rows < len(ids) and rows * width >= sum(lengths)
    # eager / sdpa: the mask comes from the position ids
    assert mb.boundaries is None and mb.attention_mask is None
    # row 0: the longest sequence alone, positions 0..
    assert mb.position_ids[0].tolist() == list(range(width))
    # the other rows hold several sequences, each restarting at 0
    assert (mb.position_ids == 0).sum() > rows
    model = _model("sdpa")
    torch.testing.assert_close(
        token_logprobs(model, mb, SETTINGS), _alone(model, rollouts, ids), rtol=0, atol=2e-6
    )
    one = collate(rollouts, ids, 0, torch.device("cpu"), one_row=True)
    assert one.input_ids.shape == (1, sum(lengths))
    assert one.boundaries["cu_seq_lens_q"].tolist() == [
        0,
        *torch.tensor(lengths).cumsum(0).tolist(),
    ]
    assert one.boundaries["max_length_q"] == max(lengths)


def test_the_chunk_follows_the_budget_unless_tokens_are_given():
    budget = LossSettings(LOSS, 1.0, "torch", None, True, chunk_mib=64)
    assert budget.chunk(151_936, torch.float32) == 55
    assert budget.chunk(151_936, torch.bfloat16) == 44  # 2 + 8 bytes an entry on the torch path
    triton = LossSettings(LOSS, 1.0, "triton", None, True, chunk_mib=64)
    assert triton.chunk(151_936, torch.bfloat16) == 220
    given = LossSettings(LOSS, 1.0, "torch", 512, True, chunk_mib=64)
    assert given.chunk(151_936, torch.float32) == 512


def test_a_chunked_micro_batch_scores_the_same_as_one_chunk():
    """The chunk only bounds memory: a budget of a few tokens' rows gives the numbers of one chunk
    for all."""
    rollouts, _ = fixed_rollouts()
    model = _model("sdpa")
    mb = collate(rollouts, [4, 0, 7], 0, torch.device("cpu"), packed=True)
    row_bytes = 64 * 8  # the tiny model's vocabulary of 64, float32 on the torch path
    tiny_budget = LossSettings(LOSS, 1.0, "torch", None, True, chunk_mib=3 * row_bytes / 2**20)
    assert tiny_budget.chunk(64, torch.float32) == 3
    whole = LossSettings(LOSS, 1.0, "torch", 10_000, True)
    torch.testing.assert_close(
        token_logprobs(model, mb, tiny_budget), token_logprobs(model, mb, whole), rtol=0, atol=1e-6
    )


def test_the_token_mask_marks_the_tokens_the_model_reads():
    """MicroBatch.token_mask (what an MoE router's load balance counts): 1 on every sequence's
    tokens, 0 on a padded row's end and on a packed row's unused end, in every layout and in each
    sequence-parallel shard."""
    rollouts, _ = fixed_rollouts()
    ids = list(range(9))
    for layout in ({"packed": True}, {"packed": False}, {"one_row": True}):
        mb = collate(rollouts, ids, 0, torch.device("cpu"), **layout)
        mask = mb.token_mask
        assert mask.shape == mb.input_ids.shape and int(mask.sum()) == mb.sequence_tokens
        flat = mask.reshape(-1).bool()
        # every trained token and its input
        assert flat[mb.logit_index].all() and flat[mb.logit_index + 1].all()
    packed = collate(rollouts, ids, 0, torch.device("cpu"))
    # unused ends
    assert (
        packed.position_ids is not None and int(packed.token_mask.sum()) < packed.token_mask.numel()
    )
    padded = collate(rollouts, ids, 0, torch.device("cpu"), packed=False)
    shards = [shard_sequences(padded, len(ids), rank, 2, 0) for rank in range(2)]
    assert sum(int(s.token_mask.sum()) for s in shards) == padded.sequence_tokens
    assert all(int(s.token_mask.sum()) == s.sequence_tokens for s in shards)
