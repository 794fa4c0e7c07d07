"""The public surface: a small top level, the seed's API in ``aitraining_pl.compat``, the older import paths
still working (the seed paths as re-exports, dropped top-level names with a DeprecationWarning)."""

from __future__ import annotations

import importlib
import warnings

import pytest

import aitraining_pl

TOP_LEVEL = {
    "SFTModule", "DPOModule", "RewardModule", "PairwiseRewardModule", "MultiObjectiveRewardModule", "PPOModule",
    "GRPOModule", "RLOOModule", "KTOModule", "ORPOModule", "CPOModule", "DistillationModule",
    "SFTDataModule", "PreferenceDataModule", "KTODataModule", "ScoresDataModule", "PromptDataModule",
    "AdaptiveKLCallback", "ExactResumeCallback", "HFExportCallback", "NonFiniteGuard", "SamplingCallback",
    "GreedyEvalCallback", "SyncReferenceCallback", "CompletionLogCallback",
    "FSDP2Strategy", "LoRAConfig", "QuantizationConfig", "GenerationConfig", "AlignmentCLI", "main",
}  # fmt: skip


def test_the_top_level_exports_modules_datamodules_callbacks_configs_and_the_cli():
    assert set(aitraining_pl.__all__) == TOP_LEVEL
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in aitraining_pl.__all__:
            assert getattr(aitraining_pl, name) is not None


@pytest.mark.parametrize("name", sorted(aitraining_pl._MOVED))
def test_dropped_top_level_names_warn_and_name_the_new_path(name):
    new_module = aitraining_pl._MOVED[name]
    with pytest.warns(DeprecationWarning, match=f"from {new_module} import {name}"):
        value = getattr(aitraining_pl, name)
    assert value is getattr(importlib.import_module(new_module), name)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        aitraining_pl.NoSuchThing  # noqa: B018


def test_the_seed_paths_re_export_the_compat_objects():
    from aitraining_pl import compat
    from aitraining_pl.compat import dpo, environments, facades, forward_backward, reward_trainer

    old = {name: importlib.import_module(f"aitraining_pl.{name}") for name in ("dpo", "facades", "reward_trainer")}
    assert old["facades"].PPOTrainer is facades.PPOTrainer is compat.PPOTrainer
    assert old["facades"].DPOConfig is compat.DPOConfig
    assert old["reward_trainer"].RewardModelTrainer is reward_trainer.RewardModelTrainer is compat.RewardModelTrainer
    assert old["dpo"].PreferenceDataset is dpo.PreferenceDataset is compat.PreferenceDataset
    assert old["dpo"].DPOTrainer is compat.DPOTrainer
    old_fb = importlib.import_module("aitraining_pl.forward_backward")
    assert old_fb.AsyncTrainingClient is forward_backward.AsyncTrainingClient is compat.AsyncTrainingClient
    assert importlib.import_module("aitraining_pl.forward_backward.pipeline") is forward_backward.pipeline
    assert environments.Observation is importlib.import_module("aitraining_pl.environments").Observation
    for name in compat.__all__:
        assert getattr(compat, name) is not None


def test_the_seed_paths_warn_with_one_policy():
    """The four top-level seed import paths and the moved top-level names warn alike (docs/from_the_seed.md)."""
    import subprocess
    import sys

    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    import aitraining_pl.dpo, aitraining_pl.facades, aitraining_pl.reward_trainer\n"
        "    import aitraining_pl.forward_backward\n"
        "    from aitraining_pl import PPOConfig\n"
        "for w in seen:\n"
        "    if w.category is DeprecationWarning and 'aitraining_pl' in str(w.message):\n"
        "        print(str(w.message))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if "will be removed in the next release: use" in line]
    for name in ("dpo", "facades", "reward_trainer", "forward_backward"):
        assert f"'import aitraining_pl.{name}' is deprecated" in out and f"'import aitraining_pl.compat.{name}'" in out
    assert "'from aitraining_pl import PPOConfig' is deprecated" in out and len(set(lines)) == 5, out


@pytest.mark.parametrize(
    "package, base",
    [
        ("aitraining_pl.modules", "lightning.pytorch.LightningModule"),
        ("aitraining_pl.datamodules", "lightning.pytorch.LightningDataModule"),
        ("aitraining_pl.callbacks", "lightning.pytorch.Callback"),
    ],
)
def test_subpackages_export_their_classes(package, base):
    """``modules/``, ``datamodules/`` and ``callbacks/`` export every module, data module and callback class from
    their ``__init__``, as ``models/`` and ``losses/`` do (issue 25)."""
    import inspect
    import pkgutil

    module_name, _, class_name = base.rpartition(".")
    kind = getattr(importlib.import_module(module_name), class_name)
    exported = importlib.import_module(package)
    found = set()
    for info in pkgutil.iter_modules(exported.__path__):
        sub = importlib.import_module(f"{package}.{info.name}")
        for name, obj in vars(sub).items():
            if inspect.isclass(obj) and issubclass(obj, kind) and obj.__module__ == sub.__name__:
                if not name.startswith("_"):
                    found.add(name)
    assert found and found <= set(exported.__all__), sorted(found - set(exported.__all__))
    assert all(getattr(exported, name) is not None for name in exported.__all__)
