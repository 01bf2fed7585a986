"""Random numbers keyed by sample, so that a sample does not depend on the batch it was drawn in.

The hf engine draws one uniform number per row and decode step
(grpo_ds.rollout.hf_sampling.sample_tokens). Drawn from torch's global generator, those numbers
follow the batch: the same prompt got other samples on 2 ranks than on 1, and a run could not
continue on another world size as if it had run there. Here a row's number at step t is a hash of
(the row's key, t), where the key comes from the call's seed and the sample's place in the step's
batch (``SamplingParams.first_prompt``): the same sample gets the same numbers however the step's
prompts are spread over ranks and generate calls. vLLM gets the same property from one seed per
request (grpo_ds.rollout.vllm).

The hash is counter-based and runs on the device in int64 tensors: 32-bit lanes mixed by xor-shifts
and multiplications by odd constants below 2**31 (products stay below 2**63, so nothing overflows),
each mix a bijection of the 32-bit lane. Two lanes give one float64 in [0, 1) with 53 random bits,
as numpy builds its doubles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_LANE = 0xFFFFFFFF
_WORD = 0xFFFFFFFFFFFFFFFF


def _mix(x):
    """A bijection of 32-bit values (a Python int, or an int64 tensor of values below 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LANE
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _LANE
    return x ^ (x >> 16)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _WORD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _WORD
    return z ^ (z >> 31)


class RowStreams:
    """One stream of uniform numbers per row: ``uniform(t)`` is every row's t-th number, a function
    of (``seed``, the row's key, t) only. ``keys[i]`` names row i's sample within the call's seed
    (e.g. its place in the step)."""

    def __init__(self, seed: int, keys: Sequence[int], device: torch.device | str = "cpu") -> None:
        base = _splitmix64(seed & _WORD)
        words = [_splitmix64(base ^ (key & _WORD)) for key in keys]
        self._high = torch.tensor([w >> 32 for w in words], dtype=torch.long, device=device)
        self._low = torch.tensor([w & _LANE for w in words], dtype=torch.long, device=device)

    def __len__(self) -> int:
        return self._high.numel()

    def uniform(self, t: int | torch.Tensor) -> torch.Tensor:
        """(rows,) float64 in [0, 1): each row's t-th number (``t``: one for every row, or (rows,)
        int64, each row's own: rows that joined a running batch at different times)."""
        step = _mix((t * 0x9E3779B9 + 0x632BE5AB) & _LANE)
        first = _mix(self._high ^ step)
        a = _mix(first ^ self._low)  # 32 random bits
        b = _mix(a ^ self._high ^ 0x5851F42D)  # 32 more
        # (27 bits * 2**26 + 26 bits) / 2**53
        return ((a >> 5) * 67108864 + (b >> 6)).double() / 9007199254740992.0

    def take(self, rows: torch.Tensor) -> RowStreams:
        """The streams of ``rows`` (indices), in that order."""
        return self._of(self._high[rows], self._low[rows])

    @staticmethod
    def joined(parts: Sequence[RowStreams]) -> RowStreams:
        """The rows of ``parts``, one after the other (each part may have its own seed)."""
        return RowStreams._of(
            torch.cat([p._high for p in parts]), torch.cat([p._low for p in parts])
        )

    @staticmethod
    def _of(high: torch.Tensor, low: torch.Tensor) -> RowStreams:
        streams = RowStreams.__new__(RowStreams)
        streams._high, streams._low = high, low
        return streams
