"""One rank's sequences cut into micro-batches, by a sample count or a token budget: a pure
function, no torch.

The step's planner (grpo_ds.step.plan) cuts each rank's shard of a mini-batch with it, and the
reward models' scorer (grpo_ds.reward_models.scorer) each rank's share of a step's texts, so it sits
below both.
"""

from __future__ import annotations

from grpo_ds.errors import UserError

MicroBatch = tuple[int, ...]  # sample ids; () is a padding micro-batch


def pack_micro_batches(
    sample_ids: list[int],
    tokens: dict[int, int],
    *,
    max_samples: int | None = None,
    max_tokens: int | None = None,
    packed: bool = False,
) -> list[MicroBatch]:
    """Cut one rank's shard into micro-batches of at most ``max_samples`` samples, or (dynamic
    batching) of at most ``max_tokens`` tokens: the sum of the sequences' lengths when they are
    ``packed`` into one row, else len(micro-batch) x its longest sequence (the padded rows).

    Dynamic batching fills micro-batches longest-first (first-fit decreasing): padded, similar
    lengths share a micro-batch, so little is padding; packed, the budget is filled with real
    tokens.
    """
    ordered = sorted(sample_ids, key=lambda s: (-tokens[s], s))
    if max_tokens is None:
        assert max_samples is not None and max_samples > 0
        return [tuple(ordered[i : i + max_samples]) for i in range(0, len(ordered), max_samples)]
    bins: list[list[int]] = []
    for sid in ordered:
        if tokens[sid] > max_tokens:
            raise UserError(
                "train.max_tokens_per_micro_batch",
                f"a sequence of {tokens[sid]} tokens (prompt + completion) is longer "
                f"than the cap {max_tokens}",
                f"raise the cap to at least {tokens[sid]} (max_prompt_tokens + "
                "max_new_tokens is safe)",
            )
        for b in bins:  # b[0] is the longest in its bin (longest-first order)
            cost = (
                sum(tokens[x] for x in b) + tokens[sid] if packed else (len(b) + 1) * tokens[b[0]]
            )
            if cost <= max_tokens:
                b.append(sid)
                break
        else:
            bins.append([sid])
    return [tuple(b) for b in bins]
