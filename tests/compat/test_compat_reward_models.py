"""The seed-only reward-model methods live in the compatibility layer: the core classes have none, the seed's names
(``aitraining_pl.compat``) resolve to the classes that have them, and both read and write the same folders."""

from __future__ import annotations

import pytest
from conftest import TINY_LLAMA

from aitraining_pl import compat
from aitraining_pl.models import MultiObjectiveRewardModel, PairwiseRewardModel, RewardModel, RewardModelConfig, reward

SEED_ONLY = ("forward_pair", "compute_bradley_terry_loss", "compute_multi_objective_loss")


def test_the_core_reward_models_have_no_seed_only_method():
    for cls in reward.REWARD_MODEL_CLASSES.values():
        assert not [name for name in SEED_ONLY if hasattr(cls, name)], cls.__name__


def test_the_seeds_names_resolve_to_the_classes_with_its_methods():
    assert issubclass(compat.PairwiseRewardModel, PairwiseRewardModel)
    assert hasattr(compat.PairwiseRewardModel, "forward_pair")
    assert hasattr(compat.PairwiseRewardModel, "compute_bradley_terry_loss")
    assert issubclass(compat.MultiObjectiveRewardModel, MultiObjectiveRewardModel)
    assert hasattr(compat.MultiObjectiveRewardModel, "compute_multi_objective_loss")
    with pytest.warns(DeprecationWarning):
        import aitraining_pl

        assert aitraining_pl.PairwiseRewardModel is compat.PairwiseRewardModel


def test_the_seeds_classes_save_and_load_the_core_folders(tmp_path):
    config = RewardModelConfig(model_config={**TINY_LLAMA, "num_hidden_layers": 1}, tokenizer_name="byte")
    folder = compat.PairwiseRewardModel(config).save_pretrained(tmp_path / "pair")
    assert type(reward.load_reward_model(folder)) is PairwiseRewardModel  # the core class, as saved
    assert type(compat.PairwiseRewardModel.from_pretrained(folder)) is compat.PairwiseRewardModel
    plain = RewardModel(config).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a PairwiseRewardModel"):
        compat.PairwiseRewardModel.from_pretrained(plain)
