"""The loss configurations the tests build: a recipe's, so that no test writes a second copy of
its defaults."""

from grpo_ds.algo.policy_loss import LossConfig
from grpo_ds.config.recipe import AlgorithmConfig


def loss_config(**algorithm) -> LossConfig:
    """The loss of a recipe whose ``algorithm`` section sets these keys, the others at the schema's
    defaults (grpo_ds.config.recipe.AlgorithmConfig), built as the trainer builds it
    (``LossConfig.from_recipe``)."""
    return LossConfig.from_recipe(AlgorithmConfig(**algorithm))
