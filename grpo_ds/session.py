"""A run's long-lived parts, opened in order on each rank and closed in reverse on every exit path.

``Session`` is a context manager: ``open_trainer`` (a trainer rank) or ``open_rollout`` (a rollout
rank of a split placement) opens the rank's parts, and leaving the ``with`` block closes them, last
opened first, whether the run ended, was preempted, failed or was interrupted. A trainer rank opens:

    run lock (rank 0) -> run folder -> reward workers (rank 0, colocated) -> metrics logger
    -> rollout engine (colocated; before the policy, as vLLM measures the free memory) -> policy
        (ZeRO-3)
    -> learned reward models -> schedule (colocated, or the trainer's side of the bridge) -> resume

and a rollout rank: reward workers (the first rollout rank) -> rollout engine -> the bridge. Which
parts a rank opens is decided here, once; the driver loop (grpo_ds/train.py) then runs the steps
with ``session.ctx``, the ``StepContext`` every phase reads.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from grpo_ds.config.deepspeed import rollout_shares_policy
from grpo_ds.config.reward_specs import reward_specs
from grpo_ds.distributed import launcher
from grpo_ds.distributed.bridge import (
    Bridge,
    Verdict,
    await_trainer_start,
    await_verdict,
    meet_rollout_ranks,
    publish_rollout_start,
    publish_trainer_start,
    publish_verdict,
)
from grpo_ds.distributed.ranks import Dist
from grpo_ds.errors import Relayed, UserError
from grpo_ds.model import sequence_parallel
from grpo_ds.model.loading import load_model
from grpo_ds.model.policy import Policy
from grpo_ds.reward_models.scorer import RewardModels
from grpo_ds.rewards.pool import RewardPool, worker_count
from grpo_ds.rollout.agent import AgentRolloutEngine
from grpo_ds.rollout.base import RolloutEngine
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.hf_compile import CompiledDecode, compile_wanted
from grpo_ds.run import checkpoint, writes
from grpo_ds.run import folder as run_folder
from grpo_ds.run.lock import RunLock
from grpo_ds.run.metrics import MetricsLogger, read_metrics
from grpo_ds.run.preemption import StopRequest
from grpo_ds.run.preflight import Inputs
from grpo_ds.run.prompts import PromptSampler
from grpo_ds.step.context import StepContext
from grpo_ds.step.schedule import Colocated, SplitTrainer
from grpo_ds.step.update import UpdateSettings


class Session:
    """One rank's run: its parts, opened by ``open_trainer`` or ``open_rollout``, closed when the
    ``with`` ends."""

    def __init__(self, inputs: Inputs, dist: Dist, stop: StopRequest) -> None:
        self.ctx = StepContext(inputs, dist)
        self.stop = stop
        self.policy: Policy | None = None
        self.schedule: Colocated | SplitTrainer | None = None
        self.bridge: Bridge | None = None  # a rollout rank's end of the bridge
        self.rank_log: Path | None = None  # this rank's own log (ranks/rank<N>.jsonl)
        self.first_step = 1
        # the history of a run that had already finished: nothing to do
        self.finished: list[dict] | None = None
        self._parts = ExitStack()  # what closes each opened part, last opened first

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self._parts.close()

    # ------------------------------------------------------------------------------- a trainer rank

    def open_trainer(self) -> None:
        """Open a trainer rank's parts, in order (the module's docstring), or set ``finished``.
        Under split placement the rollout ranks learn from the trainer's rank 0 whether the run
        goes on, ends (finished) or is refused, before anything loads (``Verdict``), and again once
        the parts are open, before training (grpo_ds.distributed.bridge)."""
        try:
            folder = self._take_run_folder()
        except UserError as err:
            self._tell_rollout_ranks(Verdict.refusal(err))
            raise
        self._tell_rollout_ranks(Verdict("finished" if self.finished is not None else "go"))
        if self.finished is not None:
            return
        try:
            self._open_trainer_parts(folder)
        except UserError as err:
            placement, dist = self.ctx.inputs.placement, self.ctx.dist
            if placement.split and dist.is_main and not isinstance(err, Relayed):
                publish_trainer_start(dist.store, Verdict.refusal(err), placement.rollout_ranks)
            raise

    def _open_trainer_parts(self, folder: run_folder.RunFolder) -> None:
        ctx, dist, recipe = self.ctx, self.ctx.dist, self.ctx.recipe
        inputs = ctx.inputs
        # they load the functions while the models load
        if dist.is_main and not inputs.placement.split:
            self._start_reward_pool()
        # rank 0 writes
        dist.decide(run_folder.prepare, folder, recipe, inputs.ds_config, inputs.data_identity)
        # W&B starts before the models load; a failure stops every rank
        ctx.logger = self._start_logger()
        torch.manual_seed(recipe.run.seed)
        self._open_models()
        # a reward function that a worker cannot load is refused now, not at the first step
        dist.decide(_rewards_ready, inputs)
        self.rank_log = ctx.run_dir / "ranks" / f"rank{dist.rank}.jsonl"
        self.rank_log.parent.mkdir(parents=True, exist_ok=True)
        policy = self.policy
        ctx.settings = UpdateSettings.from_recipe(
            recipe,
            inputs.tokenizer.pad_token_id,
            inputs.kernels_backend,
            policy.fused_lm_head_allowed,
            policy.packing_allowed,
            policy.packs_one_row,
        )
        # the order of each step's phases across ranks (grpo_ds.step.schedule): who generates, when
        # weights travel
        sampler = PromptSampler(len(inputs.prompts), recipe.run.seed, recipe.data.shuffle)
        first_step, resumed_state, data_changed = _resume(
            folder, policy, sampler, ctx.logger, dist, self.rank_log
        )
        self.schedule = self._open_schedule(sampler)
        self.first_step = first_step
        self.schedule.start(first_step - 1, policy, resumed_state, data_changed)

    def _take_run_folder(self) -> run_folder.RunFolder:
        """The run lock (rank 0), then the run folder's decision: fresh, resume, finished already
        (``finished`` set), or refused (another recipe's run, data that changed under a resumed
        one, a resume on another world size that cannot be)."""
        ctx, dist, recipe = self.ctx, self.ctx.dist, self.ctx.recipe
        lock = RunLock(run_folder.folder_path(recipe)) if dist.is_main else None
        dist.decide(_acquire, lock)  # rank 0 takes it; a live holder stops every rank with one line
        if lock is not None:
            self._parts.callback(lock.release)
        folder = run_folder.decide(recipe, ctx.inputs.data_identity)
        ctx.run_dir = folder.path
        # what a step abandoned at a stop signal's deadline names
        self.stop.track(ctx.run_dir, None)
        if folder.completed_steps is not None:
            launcher.say(
                f"the run in {ctx.run_dir} has already finished its {folder.completed_steps} "
                "steps: nothing to do (raise train.steps to continue it; run.overwrite=true or "
                "another run.name starts again)"
            )
            # the finished run's history, as grpo_ds.plot reads it
            self.finished = read_metrics(ctx.run_dir)
            return folder
        run_folder.check_world_size(folder, recipe, ctx.inputs.ds_config, dist.world_size)
        return folder

    def _tell_rollout_ranks(self, verdict: Verdict) -> None:
        """Split placement, the trainer's rank 0: the verdict for the rollout ranks."""
        placement = self.ctx.inputs.placement
        if placement.split and self.ctx.dist.is_main:
            publish_verdict(self.ctx.dist.store, verdict, placement.rollout_ranks)

    def _open_models(self) -> None:
        """The rollout engine, the policy and the learned reward models of a trainer rank. The
        rollout engine comes before the trainer (vLLM measures the free GPU memory), except one that
        generates with the policy's own module (hf / agent where every rank holds it whole: no copy,
        no weight sync); under split placement the trainer's ranks hold none."""
        ctx, recipe, inputs = self.ctx, self.ctx.recipe, self.ctx.inputs
        split = inputs.placement.split
        shared = rollout_shares_policy(recipe, inputs.ds_config)
        if not shared and not split:
            ctx.rollout = self._hold_engine(_rollout_engine(inputs, ctx.dist))
        self.policy = Policy.build(
            recipe, inputs.ds_config, len(inputs.tokenizer), announce=ctx.dist.is_main
        )
        if shared and not split:
            ctx.rollout = self._hold_engine(
                _rollout_engine(inputs, ctx.dist, self.policy.engine.module)
            )
        # learned reward models: frozen, partitioned like the reference model, on every trainer rank
        if inputs.reward_models:
            ctx.reward_models = RewardModels.build(
                inputs.reward_models,
                inputs.ds_config,
                ctx.dist,
                _reward_model_tokens(inputs),
                recipe.train.packing,
                announce=ctx.dist.is_main,
            )

    def _open_schedule(self, sampler: PromptSampler) -> Colocated | SplitTrainer:
        """The trainer's side of the step's phase order: colocated, or split (rank 0 holds the
        bridge)."""
        ctx, placement = self.ctx, self.ctx.inputs.placement
        if not placement.split:
            return Colocated(ctx, sampler)
        # the rollout ranks' parts are open too, or every rank ends here
        ctx.dist.decide(_meet_rollout_ranks, ctx.dist.store, placement.rollout_ranks)
        bridge = (
            Bridge(
                ctx.dist.store,
                0,
                placement.rollout_ranks + 1,
                ctx.dist.device,
                ctx.recipe.rollout.transfer_timeout_s,
            )
            if ctx.dist.is_main
            else None
        )
        return SplitTrainer(ctx, bridge)

    # ------------------------------------------------------------------------------- a rollout rank

    def open_rollout(self) -> None:
        """Open a rollout rank's parts: the reward workers on the first of them, the engine and the
        bridge. No lock, no run files but its log."""
        ctx, dist, recipe = self.ctx, self.ctx.dist, self.ctx.recipe
        ctx.run_dir = run_folder.folder_path(recipe)
        verdict = await_verdict(dist.store, dist.rank)  # before anything loads
        if verdict.refused:  # the trainer's rank 0 says it
            raise Relayed(verdict.where, verdict.what, verdict.fix)
        if verdict.kind == "finished":
            self.finished = read_metrics(ctx.run_dir)
            return
        try:
            if dist.is_main:
                self._start_reward_pool()
            torch.manual_seed(recipe.run.seed)
            ctx.rollout = self._hold_engine(_rollout_engine(ctx.inputs, dist))
            _rewards_ready(ctx.inputs)
        except UserError as err:  # _generate prints it on the first rollout rank
            publish_rollout_start(dist.store, dist.rank, Verdict.refusal(err, dist.is_main))
            raise
        publish_rollout_start(dist.store, dist.rank, Verdict("go"))
        started = await_trainer_start(dist.store, dist.rank)
        if started.refused:  # the trainer's side, or another rollout rank, refused
            raise Relayed(started.where, started.what, started.fix)
        self.bridge = Bridge(
            dist.store,
            1 + dist.rank,
            ctx.inputs.placement.rollout_ranks + 1,
            dist.device,
            recipe.rollout.transfer_timeout_s,
            shares=recipe.rollout.continuous,
        )
        self.rank_log = ctx.run_dir / "ranks" / f"rank{dist.launch_rank}.jsonl"
        self.stop.track(ctx.run_dir, None)

    # ------------------------------------------------------------------------------------ the parts

    def _hold_engine(self, engine: RolloutEngine) -> RolloutEngine:
        """vLLM's shutdown takes the process group down: it closes after every other part that may
        need one."""
        self._parts.callback(engine.close)
        return engine

    def _start_reward_pool(self) -> None:
        """The reward workers (grpo_ds/rewards/pool.py) on the rank that scores: they load the
        functions while the models load."""
        inputs = self.ctx.inputs
        r = inputs.recipe.reward
        processes = worker_count(r.processes)
        if processes and r.functions:
            inputs.reward_pool = RewardPool(
                reward_specs(r).functions, processes, r.worker_memory_gib
            )
            self._parts.callback(inputs.reward_pool.close)

    def _start_logger(self) -> MetricsLogger:
        """The metrics logger (rank 0 writes metrics.jsonl and starts TensorBoard / W&B). A sink
        that cannot start raises on every rank, so that no rank is left waiting for rank 0 in a
        collective."""
        ctx, recipe = self.ctx, self.ctx.recipe
        logger, failure = None, None
        try:
            logger = MetricsLogger(
                ctx.run_dir if ctx.dist.is_main else None,
                recipe.train.steps,
                recipe.logging,
                recipe.run.name,
                recipe.to_dict(),
            )
        except UserError as err:
            failure = err
        writes.agree(ctx.dist, failure)
        self._parts.callback(logger.close)
        return logger


def _acquire(lock: RunLock) -> None:
    lock.acquire()


def _rewards_ready(inputs: Inputs) -> None:
    """The rank that scores: its reward workers have loaded the functions (or one line now)."""
    if inputs.reward_pool is not None:
        inputs.reward_pool.wait_ready()


def _meet_rollout_ranks(store, rollout_ranks: int) -> None:
    """Split placement, the trainer's rank 0 (through dist.decide: every trainer rank raises what it
    raises): the rollout ranks' starts; a refusal among them ends the trainer's ranks too, printed
    here where the rollout rank that made it could not."""
    word = meet_rollout_ranks(store, rollout_ranks)
    if word.refused:
        error = Relayed if word.kind == "refused" else UserError
        raise error(word.where, word.what, word.fix)


def _rollout_engine(
    inputs: Inputs, dist: Dist, shared_module: torch.nn.Module | None = None
) -> RolloutEngine:
    """The rollout engine: hf and agent generate with ``shared_module`` (the policy's own, where
    every rank holds it whole: grpo_ds.config.deepspeed.rollout_shares_policy) or else with an
    unsharded copy of the policy, loaded here (the one full copy a rank holds); vLLM loads its own
    weights from model.path and gets no copy."""
    if inputs.recipe.uses_vllm:
        return _vllm_engine(inputs)
    recipe, tokenizer = inputs.recipe, inputs.tokenizer
    r = recipe.rollout
    shared = shared_module is not None
    model = (
        shared_module
        if shared
        else load_model(recipe.model, len(tokenizer), recipe.run.seed).to(dist.device)
    )
    # Ulysses replaces the policy's attention process-wide
    if recipe.train.sequence_parallel_size > 1:
        sequence_parallel.keep_out(model)
    if r.engine == "agent":
        return AgentRolloutEngine.on_hf(
            model,
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            tokenizer,
            inputs.env_factory,
            r.max_turns,
            recipe.max_response_tokens,
            r.generation_batch_prompts,
            shared,
        )
    compiled = (
        CompiledDecode(dist.device, r.hf_compile_timeout_s)
        if compile_wanted(r.hf_compile, dist.device)
        else None
    )  # rollout.hf_compile
    return HFRolloutEngine(
        model,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        r.generation_batch_prompts,
        shared,
        compiled,
    )


def _vllm_engine(inputs: Inputs) -> RolloutEngine:
    """vLLM's engine (imported only when chosen: an optional extra), or the agent engine's turns
    from it."""
    from grpo_ds.rollout.vllm import VLLMRolloutEngine, VLLMSettings

    recipe, tokenizer = inputs.recipe, inputs.tokenizer
    r = recipe.rollout
    engine = VLLMRolloutEngine(
        VLLMSettings.from_recipe(recipe),
        tokenizer,
        lambda: load_model(recipe.model, len(tokenizer), recipe.run.seed),
    )
    if r.engine != "agent":
        return engine
    return AgentRolloutEngine(
        engine,
        tokenizer,
        inputs.env_factory,
        r.max_turns,
        recipe.max_response_tokens,
        r.generation_batch_prompts,
    )


def _reward_model_tokens(inputs: Inputs) -> int:
    """The token budget of one reward-model micro-batch: the planner's
    (train.max_tokens_per_micro_batch), else the log-prob phase's samples per micro-batch times the
    longest prompt + response."""
    t = inputs.recipe.train
    longest = max(len(p.prompt_ids) for p in inputs.prompts) + inputs.recipe.max_response_tokens
    return t.max_tokens_per_micro_batch or t.logprob_micro_batch_samples_per_gpu * longest


# ------------------------------------------------------------------------------------------ resume


def _resume(
    folder: run_folder.RunFolder,
    policy: Policy,
    sampler: PromptSampler,
    logger: MetricsLogger,
    dist: Dist,
    rank_log: Path,
) -> tuple[int, dict | None, bool]:
    """Restore the newest good checkpoint (or the one checkpoint.resume names); return the first
    step to run, the checkpoint's trainer state (None: a fresh start) and whether data.train changed
    since it was written."""
    if folder.checkpoint is not None:
        path = folder.checkpoint
    elif folder.fresh:
        return 1, None, False
    else:
        path, damaged = checkpoint.choose(folder.path) if dist.is_main else (None, [])
        for message in damaged:
            launcher.say(f"warning: {message}")
        path = dist.broadcast(path)
    if path is None:  # the run stopped before its first checkpoint: it starts over
        _trim_logs(folder.path, rank_log, 0, dist)
        return 1, None, False
    resumed = checkpoint.load(policy, path, dist)
    changed = folder.data_changed is not None
    sampler.load_state_dict(resumed.trainer_state["sampler"], data_changed=changed)
    if folder.data_changed:
        launcher.say(
            f"note: data.train changed since the run started ({folder.data_changed}); "
            'data.on_change is "continue": a new pass over the changed data begins'
        )
    logger.resume(resumed.trainer_state["history"])
    _trim_logs(folder.path, rank_log, resumed.step, dist)
    launcher.say(f"resuming after step {resumed.step} from {path}")
    dist.barrier()
    return resumed.step + 1, resumed.trainer_state, changed


def _trim_logs(run_dir: Path, rank_log: Path, last_step: int, dist: Dist) -> None:
    """metrics.jsonl (rank 0) and each rank's own log cut back to ``last_step``; a write that fails
    on any rank stops every rank with one error."""
    with checkpoint.run_file_writes(dist, run_dir, "resume"):
        run_folder.trim_log(rank_log, last_step)
        if dist.is_main:
            run_folder.trim_metrics(run_dir, last_step)
    dist.barrier()
