"""Where generation runs (rollout.placement), checked against the world size before anything starts.

colocated (the default): every rank generates its share of a step's samples, then every rank trains
on them.

split: of W launched ranks, the first W-K (K = rollout.ranks) are the trainer, the ZeRO-3 group the
batch algebra counts (``train_batch_size = micro x grad_accum x (W-K) / (tp x sp)``); the last K
only generate, with a plain copy of the model (hf, agent) or a vLLM engine each (or tensor parallel
across them), and hold no optimizer state and no DeepSpeed engine. After every optimizer step the
trainer's weights travel to them over a process group of their own (grpo_ds.distributed.bridge).
``rollout.max_staleness`` S bounds how far the rollout ranks run ahead: a sample trained at step k
was generated with the weights of step k-1-S or newer; S = 0 takes turns and trains the same samples
as colocated. docs/guides/placement.md explains when split helps. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_ds.errors import UserError


@dataclass(frozen=True)
class Placement:
    """The launch's ranks by role. ``rollout_ranks`` is 0 when colocated."""

    world_size: int  # every launched rank
    rollout_ranks: int  # K: the last K ranks only generate (split); 0 colocated
    max_staleness: int  # S (split); 0 colocated

    @property
    def split(self) -> bool:
        return self.rollout_ranks > 0

    @property
    def trainer_ranks(self) -> int:
        """The ranks that train (all of them when colocated): the world the batch algebra and
        DeepSpeed see."""
        return self.world_size - self.rollout_ranks

    def role(self, rank: int) -> str:
        """ "colocated", "trainer" or "rollout" for a launched rank."""
        if not self.split:
            return "colocated"
        return "trainer" if rank < self.trainer_ranks else "rollout"

    def describe(self) -> str:
        if not self.split:
            return (
                f"colocated: each of the {self.world_size} ranks generates its share, then trains"
            )
        t, k = self.trainer_ranks, self.rollout_ranks
        train = "train" if t > 1 else "trains"
        generate = "generate" if k > 1 else "generates"
        return (
            f"split: {_ranks(0, t - 1)} {train} (ZeRO-3 over {t}), "
            f"{_ranks(t, self.world_size - 1)} {generate} ({k} "
            f"rank{'s' if k > 1 else ''}), staleness at most {self.max_staleness}"
        )


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def resolve_placement(recipe, world_size: int) -> Placement:
    """The recipe's placement for ``world_size`` launched ranks; one UserError for a layout that
    cannot work."""
    r = recipe.rollout
    if r.placement == "colocated":
        if r.continuous:
            raise UserError(
                "rollout.continuous",
                'needs rollout.placement "split" (colocated ranks generate, then train: their '
                "engine has nothing to keep running between steps)",
                'set rollout.placement to "split", or rollout.continuous to false',
            )
        if r.max_staleness:
            raise UserError(
                "rollout.max_staleness",
                f'{r.max_staleness} needs rollout.placement "split" (colocated '
                "ranks generate with the newest weights)",
                'set rollout.placement to "split", or rollout.max_staleness to 0',
            )
        return Placement(world_size, 0, 0)
    _check_split_ranks(recipe, world_size)
    _check_split_features(recipe)
    if r.continuous:
        _check_continuous(recipe)
    return Placement(world_size, r.ranks, r.max_staleness)


def _check_split_ranks(recipe, world_size: int) -> None:
    """Split: the rollout ranks leave a trainer whose size the tensor x sequence parallel group
    divides, and they form whole vLLM engines."""
    r = recipe.rollout
    if world_size < 2:
        raise UserError(
            "rollout.placement",
            '"split" needs at least 2 ranks (one trains, one generates); this launch has 1',
            'launch with python -m grpo_ds.launch --num_gpus 2 or more, or use "colocated"',
        )
    if r.ranks >= world_size:
        raise UserError(
            "rollout.ranks",
            f"{r.ranks} leaves no trainer rank in a world of {world_size}",
            f"use 1 to {world_size - 1}",
        )
    trainers = world_size - r.ranks
    group = recipe.train.tensor_parallel_size * recipe.train.sequence_parallel_size
    if trainers % group:
        fits = [k for k in range(1, world_size) if (world_size - k) % group == 0]
        raise UserError(
            "rollout.ranks",
            f"{r.ranks} leaves {trainers} trainer ranks, which the tensor x sequence "
            f"parallel size {group} does not divide",
            f"use one of {fits}"
            if fits
            else "lower train.tensor_parallel_size / train.sequence_parallel_size",
        )
    if recipe.uses_vllm and r.ranks % r.vllm_tensor_parallel_size:
        raise UserError(
            "rollout.vllm_tensor_parallel_size",
            f"{r.vllm_tensor_parallel_size} does not divide "
            f"rollout.ranks {r.ranks} (the rollout ranks form the vLLM engines)",
            f"use one of {[d for d in range(1, r.ranks + 1) if r.ranks % d == 0]}",
        )


def _check_split_features(recipe) -> None:
    """Split: what needs the importance-sampling correction (staleness), and what does not work
    with the trainer and the rollout engines on different ranks."""
    r = recipe.rollout
    if r.max_staleness and recipe.algorithm.rollout_is_cap is None:
        raise UserError(
            "rollout.max_staleness",
            f"{r.max_staleness} trains on samples from older weights, which "
            "needs the importance-sampling correction between sampler and trainer",
            "set algorithm.rollout_is_cap (e.g. 2.0), or rollout.max_staleness to 0",
        )
    if recipe.reward.models and recipe.algorithm.dynamic_sampling:
        raise UserError(
            "algorithm.dynamic_sampling",
            "chooses groups by their rewards on the rollout ranks, and "
            'under rollout.placement "split" the reward '
            "models score on the trainer ranks, after that",
            'use "colocated", or turn dynamic sampling off',
        )
    if recipe.eval.data is not None:
        raise UserError(
            "eval.data",
            'evaluation does not run under rollout.placement "split" yet (the trainer '
            "ranks hold no rollout engine)",
            'evaluate the saved model separately, or use "colocated"',
        )
    if recipe.rollout.vllm_sleep_mode and recipe.uses_vllm:
        raise UserError(
            "rollout.vllm_sleep_mode",
            'has nothing to give back under rollout.placement "split" (the '
            "rollout ranks hold no trainer)",
            "set it to false",
        )


def _check_continuous(recipe) -> None:
    """Continuous generation: what it runs with so far."""
    r = recipe.rollout
    if r.engine not in ("hf", "vllm"):
        raise UserError(
            "rollout.continuous",
            f'runs on the hf and vllm engines so far, not on rollout.engine "{r.engine}" '
            "(multi-turn episodes)",
            'set rollout.engine to "hf" or "vllm", or rollout.continuous to false',
        )
    if r.engine == "vllm" and r.vllm_tensor_parallel_size > 1:
        raise UserError(
            "rollout.continuous",
            "runs one vLLM engine per rollout rank so far; rollout.vllm_tensor_parallel_size is "
            f"{r.vllm_tensor_parallel_size}",
            "set rollout.vllm_tensor_parallel_size to 1, or rollout.continuous to false",
        )
    if r.prompts_per_step < r.ranks:
        raise UserError(
            "rollout.continuous",
            f"gives each rollout rank its own prompts of every step: rollout.prompts_per_step "
            f"{r.prompts_per_step} is fewer than rollout.ranks {r.ranks}",
            "raise rollout.prompts_per_step, or lower rollout.ranks",
        )
    if recipe.algorithm.dynamic_sampling:
        raise UserError(
            "rollout.continuous",
            "cannot run with algorithm.dynamic_sampling yet (a step's extra rounds depend on its "
            "first round's rewards)",
            "turn one of them off",
        )
