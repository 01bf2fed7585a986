"""Continuous generation on the ``vllm`` engine: vLLM's own continuous batching, fed a step's groups
as they are admitted, with new weights loaded between two engine steps.

The batch-by-batch engine (grpo_ds.rollout.vllm) hands vLLM a step's requests in one
``LLM.generate`` call, which returns when the last has ended. Here the schedule
(grpo_ds.step.continuous) adds a group's requests to vLLM's engine (``LLMEngine.add_request``) as
soon as the running rows leave room for them, and drives the engine one step at a time
(``LLMEngine.step``: one scheduler step, one forward, the tokens it sampled), so vLLM's scheduler
keeps its batch full across the schedule's steps.

Requests. A group of G samples is G requests of one sample each, sample k seeded with the prompt's
seed + k: the seed vLLM gives the k-th sample of one request of n = G (grpo_ds.rollout.vllm), so
both engines draw the same samples from the same weights. Each request returns its new tokens and
their log-probs at every engine step (``RequestOutputKind.DELTA``); a token records the weight
version the engine held when the step that sampled it ran.

New weights (``load_weights``) go in through the engine's weight sync (``update_weights``) between
two engine steps, with the requests in flight kept; then every running request is preempted and
recomputed (``reset_prefix_cache(reset_running_requests=True)``: vLLM moves them back to its
waiting queue, frees their KV cache and the prefix cache, and prefills prompt and generated tokens
again under the new weights before their next token). As on the hf engine
(grpo_ds.rollout.hf_continuous), each token is then sampled from exactly pi_v(token | all before it)
for its version v. (vLLM's pause(mode="keep") would keep the old keys and values of the prefix; the
recompute costs one prefill of the requests in flight per weight update.) A preempted request's
random stream starts again after the recompute, so a sample that spans an update is not the one an
uninterrupted stream would have drawn; a sample of one version is.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator

import torch

from grpo_ds.errors import UserError
from grpo_ds.rollout.hf_continuous import (
    DrawnSample,
    FinishedGroup,
    GroupRequest,
    GroupsInFlight,
)
from grpo_ds.rollout.vllm_requests import request_seeds, sampling_kwargs


class VLLMContinuous:
    """A running batch of at most ``capacity_rows`` sample requests on ``engine``'s vLLM engine
    (grpo_ds.rollout.vllm.VLLMRolloutEngine, tensor parallel size 1)."""

    def __init__(self, engine, capacity_rows: int, version: int = 0) -> None:
        from vllm.sampling_params import RequestOutputKind  # vLLM is there: the engine runs

        self._engine, self._llm = engine, engine.llm.llm_engine
        _check_recompute(self._llm)
        self._delta = RequestOutputKind.DELTA
        self.capacity_rows, self.version = capacity_rows, version
        self._samples: dict[str, DrawnSample] = {}  # request id -> its sample, until it ends
        self._groups = GroupsInFlight()
        self._ids = itertools.count()
        self._stats = [0, 0]  # since the last take_stats: engine steps, tokens picked

    @property
    def rows_in_flight(self) -> int:
        return len(self._samples)

    @property
    def free_rows(self) -> int:
        return self.capacity_rows - self.rows_in_flight

    def admit(self, request: GroupRequest) -> None:
        """``request``'s samples, one vLLM request each, join vLLM's waiting queue."""
        import vllm

        sampling = request.sampling
        (seed,) = request_seeds(sampling.seed, [sampling.first_prompt], request.size)
        for sample in self._groups.admit(request, self.free_rows):
            kwargs = sampling_kwargs(sampling, 1, self._engine.stop_ids, seed + sample.sample)
            params = vllm.SamplingParams(**kwargs, detokenize=False, output_kind=self._delta)
            request_id = f"grpo_ds-{next(self._ids)}"
            self._samples[request_id] = sample
            self._llm.add_request(
                request_id, {"prompt_token_ids": list(request.prompt_ids)}, params
            )

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """New weights between two engine steps; the requests in flight are recomputed under them
        (the module's docstring). Returns how many tensors were updated."""
        count = self._engine.update_weights(named_tensors, recompute_running=True)
        self.version = version
        return count

    def step(self) -> list[FinishedGroup]:
        """One vLLM engine step; the groups whose every sample has ended, in the order they
        ended."""
        if not self._samples:
            return []
        finished: list[FinishedGroup] = []
        outputs = self._llm.step()
        self._stats[0] += 1
        for output in outputs:
            sample = self._samples[output.request_id]
            (completion,) = output.outputs
            new = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(new):
                raise RuntimeError(
                    "vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0)"
                )
            sample.ids += new
            sample.logprobs += [
                float(p[t].logprob) for p, t in zip(completion.logprobs, new, strict=True)
            ]
            sample.versions += [self.version] * len(new)
            self._stats[1] += len(new)
            if output.finished:
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a sample with {completion.finish_reason!r}")
                sample.finish = completion.finish_reason
                del self._samples[output.request_id]
                finished += self._groups.ended(sample)
        return finished

    def take_stats(self) -> tuple[int, int]:
        """(engine steps, tokens picked over them) since the last call."""
        stats, self._stats = tuple(self._stats), [0, 0]
        return stats


def _check_recompute(llm_engine) -> None:
    """The installed vLLM can preempt and recompute its running requests when weights change
    (``reset_prefix_cache(reset_running_requests=True)``), or continuous generation is refused."""
    import vllm

    if "reset_running_requests" not in inspect.signature(llm_engine.reset_prefix_cache).parameters:
        raise UserError(
            "rollout.continuous",
            f"needs a vLLM that recomputes running requests when the weights change "
            f"(reset_prefix_cache(reset_running_requests=...)); vLLM {vllm.__version__} has none",
            "install a newer vLLM (0.32 has it), or set rollout.continuous to false",
        )
