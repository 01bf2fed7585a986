"""The ``vllm`` rollout engine: a vLLM engine colocated with the trainer in every DeepSpeed process,
on GPUs or on CPU ranks (vLLM's CPU build).

Layout. The ``deepspeed`` launcher starts one process per device; each builds a vLLM ``LLM`` with
``distributed_executor_backend="external_launcher"``: vLLM joins the launcher's process group
instead of spawning workers, and runs its engine inside this process (vllm/config/parallel.py turns
V1 multiprocessing off for that backend; vllm/v1/executor/uniproc_executor.py
ExecutorWithExternalLauncher). With ``rollout.vllm_tensor_parallel_size`` t > 1, ranks [0, t), [t,
2t), ... each form one tensor-parallel engine: the group's ranks gather their prompts, every member
runs the same requests with the same seeds (the external launcher needs identical work on every
member), and each keeps its own slice of the results. Multi-node runs are the same program started
with ``deepspeed --hostfile``; t must divide the world size (and should divide the GPUs per node, so
that a group's NCCL traffic stays inside a node).

Memory. vLLM takes ``rollout.vllm_gpu_memory_utilization`` of each GPU (on a CPU: of the machine's
memory, per engine) for its weights and KV cache; ``rollout.vllm_kv_cache_gib`` sizes the KV cache
instead. With ``rollout.vllm_sleep_mode`` the engine sleeps after every ``generate`` (vLLM's level-1
sleep: weights copied to CPU memory, KV cache dropped), wakes its weights to receive a weight sync
and its KV cache before the next generation, so the trainer has the GPU to itself in between; where
vLLM has no sleep mode (its CPU build) the key is skipped, and start-up says so.

Sampling. One vLLM request per prompt with n = group_size and its own seed (vLLM gives child k of a
request seed + k: vllm/v1/engine/parallel_sampling.py), so a step's samples do not depend on how
prompts are spread over ranks or on the run having been resumed. ``logprobs=0`` returns the sampled
token's log-prob; the engine is built with ``logprobs_mode="processed_logprobs"``, so that log-prob
is taken after temperature, top-k and top-p (vllm/v1/sample/ops/topk_topp_sampler.py), the
distribution actually sampled from, as Rollouts requires. A completion ends at any EOS id of
grpo_ds.rollout.stop (the tokenizer's and the model folder's generation config's, as vLLM does by
itself), the same set as the hf and agent engines. Temperatures in (0, 0.01), which vLLM raises to
0.01, and above 2, which newer vLLM refuses, are refused at start-up (``check_vllm_temperatures``).
``algorithm.rollout_is_cap`` then corrects the gap between vLLM's probabilities and the trainer's
(grpo_ds.algo.importance); it is recommended with this engine, and start-up prints a note when it is
off. The agent engine's turns come from ``sample_turns`` (rollout.agent_backend "vllm"): one request
per episode and round.

Weights. ``update_weights`` takes the stream of grpo_ds.model.weight_gather (transformers names, one
bucket of gathered weights alive at a time) by the path the installed vLLM offers
(``weight_sync_path``): its workers' ``reload_weights`` (an in-place reload that maps transformers
names onto vLLM's fused layers, rebuilds each layer once all its tensors arrived and re-runs the
post-load processing, e.g. the CPU backend's repacking), or the model's own ``load_weights`` through
``LLM.apply_model`` (older vLLM). Then the prefix cache is reset: cached KV was computed by the old
weights. vLLM loads its initial weights from ``model.path`` itself: the trainer keeps no copy of the
policy for it (the final model is written from the trainer's own partitioned weights,
grpo_ds.model.policy).

Supported vLLM: ``VLLM_SPEC`` (grpo_ds.config.software; also the ``grpo_ds[vllm]`` extra in
setup.cfg); 0.32.0, the CPU build, is the release tested end to end
(tests/rollout/test_vllm_cpu.py). The start-up checks and the probes of what the installed vLLM
offers are in grpo_ds.rollout.vllm_checks; the recipe's settings turned into vLLM's arguments, and
vLLM's outputs into Rollouts, in grpo_ds.rollout.vllm_requests. vLLM is imported only in
vllm_checks and in the engine's constructor; nothing here runs without it.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from grpo_ds.distributed import launcher
from grpo_ds.rollout import vllm_shm
from grpo_ds.rollout.base import Rollouts, SamplingParams, Turn
from grpo_ds.rollout.stop import folder_generation_config, stop_token_ids
from grpo_ds.rollout.vllm_checks import sleep_mode_available, weight_sync_path
from grpo_ds.rollout.vllm_continuous import VLLMContinuous
from grpo_ds.rollout.vllm_requests import (
    VLLMSettings,
    llm_kwargs,
    request_seeds,
    rollouts_from_outputs,
    sampling_kwargs,
    turn_from_output,
    turn_seed,
)

# --------------------------------------------------------------------------------------- the engine


class VLLMRolloutEngine:
    """Same surface as HFRolloutEngine (generate, update_weights) plus sleep() and wake(); no copy
    of the model.

    ``builtin_model`` builds the model when ``model.path`` is a builtin one, which vLLM cannot load
    from a name: it is written to a temporary folder once and dropped."""

    shares_policy_weights = False  # vLLM holds its own weights: every optimizer step syncs them
    model = None  # no module of grpo_ds's: vLLM loads its own

    def __init__(
        self, settings: VLLMSettings, tokenizer, builtin_model: Callable[[], torch.nn.Module]
    ) -> None:
        import vllm  # imported only when a recipe generates with vLLM

        self._vllm = vllm
        self.settings = settings
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if dist else 0
        world = torch.distributed.get_world_size() if dist else 1
        self.tp_group = _tensor_parallel_group(settings.tensor_parallel_size, world)
        folder = settings.model_path
        written = folder.startswith("builtin:")
        if written:
            folder = _save_for_vllm(builtin_model(), tokenizer)
        self.stop_ids = stop_token_ids(
            tokenizer.eos_token_id, folder_generation_config(folder, settings.trust_remote_code)
        )
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        # check_vllm_setup said so when it is not
        self.sleeps = settings.sleep_mode and sleep_mode_available()
        if on_cpu:
            _prepare_cpu_engine(settings, dist)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # vLLM checks that its share of the GPU is free
        self.llm = self._build_llm(folder, written, world, on_cpu)
        # before the process group goes (atexit runs last-registered first)
        atexit.register(self.close)
        self.reloads = weight_sync_path() == "reload_weights"
        # the reload path rebuilds each layer whole before using it: a LoRA sync then also sends the
        # frozen tensors that complete the layers it touches (grpo_ds.model.lora.layer_companions),
        # by vLLM's fused-layer map
        self.whole_layers = self.llm.apply_model(_packed_modules)[0] if self.reloads else None
        if self.reloads:
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
                _RotaryReloadFilter()
            )
        self._awake = {"weights", "kv_cache"}
        self.sleep()  # the trainer is built next

    def _build_llm(self, folder: str, written: bool, world: int, on_cpu: bool):
        """This rank's vllm.LLM, loaded from ``folder`` (removed after when ``written``, a
        temporary copy of a builtin model)."""
        # vLLM's external launcher reads the launcher's variables while it builds its engine; a
        # single process (python -m) has none of them, and keeps none of them after (it would look
        # launched to the launcher's reads)
        with launcher.as_launched(self.rank, world, launcher.local_rank()):
            try:
                kwargs = llm_kwargs(self.settings, folder, self.rank, on_cpu, self.sleeps)
                return self._vllm.LLM(**kwargs)
            finally:
                # read whole by now (weights, config, tokenizer); a launched rank leaves by
                # os._exit, which runs no exit handler
                if written:
                    shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Shut vLLM's engine down (idempotent). Its shutdown takes the process group down too
        (vllm/distributed/parallel_state.py cleanup_dist_env_and_memory), so it comes after the
        run's last collective: the driver calls it at the end of a run, and an exit handler
        otherwise (left to its own finalizer, vLLM would shut down after grpo_ds took the group
        down, and fail there)."""
        client = getattr(
            getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None
        )
        if client is not None and hasattr(client, "shutdown"):
            client.shutdown()

    # --------------------------------------------------------------------------------------- memory

    def sleep(self) -> None:
        """With rollout.vllm_sleep_mode: release vLLM's GPU memory (weights to CPU memory, KV cache
        dropped).

        vLLM's executor sleeps only when fully awake: while any tag still sleeps it ignores
        ``sleep`` (the weights woken for a sync would stay on the GPU) and then ignores a
        ``wake_up`` naming a tag it thinks is awake (the KV cache would stay unmapped for the next
        generation): vllm/v1/executor/abstract.py ``sleep``/``wake_up``. So what is still asleep is
        woken first."""
        if self.sleeps and self._awake:
            self.wake()
            self.llm.sleep(level=1)
            self._awake = set()

    def wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Bring back what sleep() released (``tags``: "weights" and/or "kv_cache")."""
        missing = [t for t in tags if t not in self._awake]
        if missing:
            # hand the trainer's cached blocks back, so vLLM can map its memory again
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=missing)
            self._awake.update(missing)

    # ----------------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        rows: list[dict] | None = None,
    ) -> Rollouts:
        """``group_size`` samples of each prompt, consecutive; ``rows`` is unused (single-turn)."""
        places = range(sampling.first_prompt, sampling.first_prompt + len(prompts))
        batch, mine = self._group_batch(list(zip(prompts, places, strict=True)))
        if not batch:  # the whole tensor-parallel group has nothing to do
            return Rollouts([], [], [], [])
        self.wake()
        params = [
            self._vllm.SamplingParams(
                **sampling_kwargs(sampling, group_size, self.stop_ids, seed),
                # token ids are all a single-turn rollout needs
                detokenize=False,
            )
            for seed in request_seeds(sampling.seed, [place for _, place in batch], group_size)
        ]
        batch = [prompt for prompt, _ in batch]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in batch], sampling_params=params, use_tqdm=False
        )
        self.sleep()
        return (
            rollouts_from_outputs(batch, outputs, group_size)
            .select(list(range(mine.start * group_size, mine.stop * group_size)))
            .drawn_with(sampling.settings)
        )

    @torch.no_grad()
    def sample_turns(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        stops: list[tuple[str, ...]],
        sampling: SamplingParams,
        keys: list[int],
    ) -> list[Turn]:
        """The agent engine's model turns (grpo_ds.rollout.base.TurnSampler): one request per
        context, prompted with its token ids, one sample of at most its budget, ending at an EOS id
        or at the token that completes one of its stop strings (vLLM ends the request there and
        keeps that token; only its text would be cut). Request ``keys[i]`` is seeded from
        (``sampling.seed``, key), so a turn's sample does not depend on the batch."""
        requests, mine = self._group_batch(list(zip(contexts, budgets, stops, keys, strict=True)))
        if not requests:
            return []
        self.wake()
        params = []
        for _, budget, stop, key in requests:
            kwargs = sampling_kwargs(
                replace(sampling, max_new_tokens=budget),
                1,
                self.stop_ids,
                turn_seed(sampling.seed, key),
            )
            params.append(
                self._vllm.SamplingParams(
                    **kwargs, stop=list(stop), include_stop_str_in_output=True
                )
            )
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(c)} for c, *_ in requests],
            sampling_params=params,
            use_tqdm=False,
        )
        turns = [turn_from_output(output, self.stop_ids) for output in outputs]
        return turns[mine.start : mine.stop]

    def keep_going(self, active: bool) -> bool:
        """Another round of turns while this rank, or any member of its tensor-parallel group, has
        an active episode: every member takes part in every round (vLLM's external launcher needs
        the same work on each)."""
        if self.tp_group is None:
            return active
        flag = torch.tensor([int(active)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        return bool(flag.item())

    def _group_batch(self, items: list) -> tuple[list, range]:
        """The requests of this rank's tensor-parallel group (every member's ``items``, in rank
        order) and which of them are this rank's."""
        if self.tp_group is None:
            return items, range(len(items))
        parts = [None] * torch.distributed.get_world_size(group=self.tp_group)
        torch.distributed.all_gather_object(parts, items, group=self.tp_group)
        me = torch.distributed.get_rank(group=self.tp_group)
        start = sum(len(p) for p in parts[:me])
        return [q for p in parts for q in p], range(start, start + len(items))

    # -------------------------------------------------------------------------------------- weights

    def continuous(self, capacity_rows: int) -> VLLMContinuous:
        """A running batch of at most ``capacity_rows`` sample requests on this engine's vLLM
        engine (rollout.continuous: grpo_ds.rollout.vllm_continuous)."""
        return VLLMContinuous(self, capacity_rows)

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterator[tuple[str, torch.Tensor]], recompute_running: bool = False
    ) -> int:
        """Load the stream into vLLM (each tensor is valid only until the next), then drop the
        cached KV; ``recompute_running``: requests are in flight (continuous generation), and vLLM
        preempts them to recompute theirs too (grpo_ds.rollout.vllm_continuous)."""
        self.wake(("weights",))
        count = [0]

        def counted(
            stream: Iterator[tuple[str, torch.Tensor]],
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                count[0] += 1
                yield name, tensor

        # vLLM re-runs its post-load processing (the CPU backend repacks linear weights)
        if self.reloads:
            # a layer's tensors are buffered until the layer is whole
            # (vllm/model_executor/model_loader/reload/layerwise.py): each is cloned, since the
            # exporter reuses its buffers for the next one
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={
                    "weights_iterator": ((n, t.clone()) for n, t in counted(named_tensors)),
                    "is_checkpoint_format": True,
                },
            )
        else:

            def load(model: torch.nn.Module) -> None:  # runs on vLLM's model, in this process
                for name, tensor in counted(named_tensors):
                    model.load_weights(weights=[(name, tensor)])

            self.llm.apply_model(load)  # one worker per process under the external launcher
        if recompute_running:
            self.llm.reset_prefix_cache(reset_running_requests=True)
        else:
            self.llm.reset_prefix_cache()
        return count[0]


def _tensor_parallel_group(tp: int, world: int):
    """This rank's tensor-parallel group: ranks [0, tp), [tp, 2 tp), ...; None when tp is 1. Every
    rank creates every group, in the same order."""
    if tp <= 1:
        return None
    group, _ = torch.distributed.new_subgroups_by_enumeration(
        [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
    )
    return group


def _prepare_cpu_engine(settings: VLLMSettings, dist: bool) -> None:
    """What vLLM's CPU build needs before its engine is built: a shared-memory name of the run's
    own, no stale segments of that name, and the KV cache size as a variable."""
    if "VLLM_DIST_IDENT" not in os.environ:
        # vLLM's CPU tensor-parallel groups share memory under /dev/shm names made from this
        # variable: a run's own name, the same on every rank, for the vLLM versions that read it
        # (vLLM 0.32's CPU worker replaces it with a name that repeats from run to run: hence
        # the leftovers' removal below)
        ident = [f"grpo_ds-{uuid.uuid4().hex[:12]}"]
        if dist:
            torch.distributed.broadcast_object_list(ident, src=0)
        os.environ["VLLM_DIST_IDENT"] = ident[0]
    # an earlier run's segments of the same name would fail the engine (EEXIST)
    if settings.tensor_parallel_size > 1:
        if launcher.local_rank() == 0 and (removed := vllm_shm.remove_stale_segments()):
            launcher.say(
                f"note: removed {len(removed)} shared-memory segment(s) of vLLM's CPU tensor "
                f"parallelism that no process holds ({', '.join(p.name for p in removed)} in "
                f"{vllm_shm.SHM}), left by an earlier run"
            )
        if dist:
            torch.distributed.barrier()  # before any rank's engine creates them again
    # whole GiB: vLLM reads the variable as an integer
    if settings.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(settings.kv_cache_gib))


def _packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """vLLM's fused layers of ``model``: {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...} (runs on
    vLLM's model)."""
    return {
        name: list(members)
        for name, members in getattr(model, "packed_modules_mapping", {}).items()
    }


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" at every in-place reload: the rotary
    embedding's cache is computed, not a checkpoint weight, so no sync ever sends it and vLLM keeps
    it as it was (its fallback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def _save_for_vllm(model: torch.nn.Module, tokenizer) -> str:
    """vLLM loads from a folder: write the builtin model and tokenizer to a temporary one of this
    rank's (removed once the engine is built). Not through model.save_pretrained, which in a process
    group writes the weights on rank 0 only (transformers' should_save_on_this_rank): every rank's
    engine reads its own folder, on every node."""
    from safetensors.torch import save_model

    folder = tempfile.mkdtemp(prefix="grpo_ds_vllm_")
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    # tied weights once
    save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder
