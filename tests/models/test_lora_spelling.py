"""LoRA settings have one spelling, ``LoRAConfig``, in the modules, ``RewardModel`` and the recipes; the old spellings
(a ``peft.LoraConfig`` or peft's field names, the seed's ``use_lora`` / ``lora_*`` fields of ``RewardModelConfig``)
still work for one release with a ``RenamedArgumentWarning``, and folders saved with the seed's fields still load."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
from conftest import TINY_LLAMA

from aitraining_pl.errors import ConfigError
from aitraining_pl.models import LoRAConfig, RewardModel, RewardModelConfig, load_reward_model
from aitraining_pl.modules import DPOModule
from aitraining_pl.validation import RenamedArgumentWarning

ROOT = Path(__file__).resolve().parents[2]
TINY = {**TINY_LLAMA, "num_hidden_layers": 1}


def test_lora_config_is_the_one_spelling_and_warns_about_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RenamedArgumentWarning)
        module = DPOModule(model_config=TINY, tokenizer_name="byte", reference_free=True, lora=LoRAConfig(r=2))
        config = RewardModelConfig(model_config=TINY, tokenizer_name="byte", lora={"r": 2, "alpha": 4})
    assert module.hparams.lora["r"] == 2 and config.lora == LoRAConfig(r=2, alpha=4)
    assert not [f.name for f in dataclasses.fields(RewardModelConfig) if f.name.startswith(("lora_", "use_lora"))]
    recipes = [p for p in (ROOT / "configs").rglob("*.yaml") if "lora_" in p.read_text() or "use_lora" in p.read_text()]
    assert not recipes, f"recipes with an old LoRA spelling: {recipes}"


def test_peft_spellings_still_work_with_a_warning():
    peft = pytest.importorskip("peft")
    make = dict(model_config=TINY, tokenizer_name="byte", reference_free=True)
    with pytest.warns(RenamedArgumentWarning, match=r"DPOModule.lora: a peft.LoraConfig is replaced by LoRAConfig"):
        module = DPOModule(**make, lora=peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"]))
    expected = {
        "r": 2,
        "alpha": 4,
        "dropout": 0.0,
        "target_modules": ["q_proj"],
        "modules_to_save": None,
        "checkpoint_base": False,
    }
    assert module.hparams.lora == expected
    with pytest.warns(RenamedArgumentWarning, match=r"peft's field names \(lora_alpha, lora_dropout\)"):
        module = DPOModule(**make, lora={"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["q_proj"]})
    assert module.hparams.lora == expected


def test_the_seeds_reward_model_lora_fields_still_work_with_a_warning():
    with pytest.warns(RenamedArgumentWarning, match=r"RewardModelConfig: 'use_lora', 'lora_rank' is replaced by lora="):
        old = RewardModelConfig(model_config=TINY, use_lora=True, lora_rank=4)
    assert old.lora == LoRAConfig(r=4, alpha=16, dropout=0.1, target_modules="all-linear")  # the seed's defaults
    assert old == RewardModelConfig(model_config=TINY, lora=LoRAConfig(r=4, alpha=16, dropout=0.1))
    with pytest.warns(RenamedArgumentWarning):
        assert RewardModelConfig(use_lora=False, lora_rank=4).lora is None  # as in the seed: no adapters
    with pytest.raises(ConfigError, match="given twice"):
        RewardModelConfig(lora=LoRAConfig(), use_lora=True)
    assert dataclasses.replace(old, seed=1).lora == old.lora  # replace() does not warn again nor lose the adapters


def test_a_folder_saved_with_the_seeds_lora_fields_loads_as_it_was_meant(tmp_path):
    model = RewardModel(RewardModelConfig(model_config=TINY, tokenizer_name="byte", lora=LoRAConfig(r=2, alpha=4)))
    model.save_pretrained(tmp_path)
    meta_file = tmp_path / "reward_config.json"
    meta = json.loads(meta_file.read_text())
    assert meta["config"]["lora"]["r"] == 2
    lora = meta["config"].pop("lora")  # the layout written before ``lora``
    meta["config"].update(use_lora=True, lora_rank=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"])
    meta["config"]["lora_target_modules"] = lora["target_modules"]
    meta_file.write_text(json.dumps(meta))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RenamedArgumentWarning)  # a saved file is not the user's spelling
        loaded = load_reward_model(tmp_path)
    assert loaded.config.lora == LoRAConfig(r=2, alpha=4)
