"""A model loaded from a folder trains in training mode (issue 49, fix 1): ``from_pretrained`` returns eval mode,
which turned dropout off for every real model while the inline tiny models (built in training mode) hid it.

Each family's module loads a saved Llama with dropout through ``model_name``; inside ``training_step`` every
submodule of the LightningModule is in training mode, and Lightning warns of no module in eval mode. The frozen
reference (held outside the module tree) stays in eval mode."""

from __future__ import annotations

import warnings

import pytest
import transformers
from conftest import TINY_LLAMA, quiet_trainer

from aitraining_pl import DPOModule, GRPOModule, PreferenceDataModule, PromptDataModule, SFTDataModule, SFTModule
from aitraining_pl.models import build_causal_lm, load_causal_lm
from aitraining_pl.rollout import GenerationConfig

PAIRS = {"prompts": ["a", "b"], "chosen": ["xy", "zz"], "rejected": ["q", "rr"]}


@pytest.fixture(scope="module")
def dropout_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dropout-llama")
    build_causal_lm({**TINY_LLAMA, "attention_dropout": 0.3}).save_pretrained(str(folder))
    transformers.ByT5Tokenizer().save_pretrained(str(folder))
    return str(folder)


def _module(family, folder):
    common = {"model_name": folder, "disable_dropout": False}
    generation = GenerationConfig(max_new_tokens=3, temperature=1.0, top_p=1.0)
    rows = [{"prompt": "a", "completion": "bc"}, {"prompt": "d", "completion": "ef"}]
    builders = {
        "sft": lambda: (
            SFTModule(**common),
            lambda tok: SFTDataModule(rows=rows, tokenizer=tok, val_split=0, batch_size=2),
        ),
        "dpo": lambda: (
            DPOModule(**common),
            lambda tok: PreferenceDataModule(**PAIRS, tokenizer=tok, val_split=0, batch_size=2),
        ),
        "grpo": lambda: (
            GRPOModule(
                **common,
                reward="aitraining_pl.rewards:char_fraction_reward",
                num_generations=2,
                mini_batch_size=4,
                kl_coef=0.04,
                generation=generation,
            ),
            lambda tok: PromptDataModule(prompts=["ab", "cd"], tokenizer=tok, batch_size=2, val_split=0),
        ),
    }
    return builders[family]()


def test_loaded_model_comes_in_training_mode(dropout_folder):
    model = load_causal_lm(dropout_folder)
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize("family", ["sft", "dpo", "grpo"])
def test_each_family_trains_in_training_mode(family, dropout_folder, tmp_path):
    module, data = _module(family, dropout_folder)
    assert module.policy.config.attention_dropout == 0.3  # dropout is live, so the mode matters
    modes, step = [], module.training_step

    def probed_step(*args, **kwargs):
        modes.append({name for name, m in module.named_modules() if not m.training})
        return step(*args, **kwargs)

    module.training_step = probed_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(tmp_path, max_steps=1).fit(module, data(module.tokenizer))
    assert modes and all(not names for names in modes), modes  # every submodule trains
    assert not [str(w.message) for w in caught if "eval mode" in str(w.message)]
    reference = getattr(module, "reference", None)
    if reference is not None and reference.frozen_copy is not None:  # the frozen reference stays frozen
        assert not reference.frozen_copy.training
