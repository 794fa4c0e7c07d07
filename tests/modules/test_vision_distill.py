"""Distillation with a vision-language teacher: the teacher scores the student's samples with the prompts' pixel values
(``models.vision_scoring``, each prompt's held once), the KL to it falls on held-out image prompts, and a teacher that
cannot see the images (a text model, a served one) is refused."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from conftest import quiet_trainer

from aitraining_pl.datamodules.colours import ColourSquaresDataModule
from aitraining_pl.datamodules.sft import SFTDataModule
from aitraining_pl.errors import ConfigError
from aitraining_pl.modules.distill import DistillationModule
from aitraining_pl.modules.sft import SFTModule

PRESET = "tiny-qwen2-vl-colours"


@pytest.fixture(scope="module")
def colour_teacher(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of a teacher that knows the colours: the tiny Qwen2-VL after SFT on the colour task (images)."""
    from test_vision_sft import sft_rows

    tmp_path = tmp_path_factory.mktemp("teacher")
    pl.seed_everything(0)
    sft = SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET, learning_rate=0.004, lr_schedule="constant")
    data = SFTDataModule(rows=sft_rows(48, seed=0), tokenizer=sft.tokenizer, val_split=0, batch_size=16)
    quiet_trainer(tmp_path, max_epochs=6, limit_val_batches=0).fit(sft, data)
    return sft.policy.state_dict()


def held_out_kl(module: DistillationModule, data, tmp_path) -> dict[str, float]:
    out = quiet_trainer(tmp_path).validate(module, data, verbose=False)[0]
    return {k: round(out[f"val/{k}"], 4) for k in ("forward_kl", "reverse_kl")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "sampled"])
def test_the_kl_to_a_vl_teacher_falls_on_held_out_image_prompts(tmp_path, mode, colour_teacher):
    pl.seed_everything(0)
    options = {
        "full": dict(beta=0.5, mini_batch_size=16),
        "sampled": dict(num_generations=8, advantage="rloo", mini_batch_size=64),
    }[mode]
    module = DistillationModule(
        model_config={"preset": PRESET},
        teacher_model_config={"preset": PRESET},
        tokenizer_name=PRESET,
        mode=mode,
        generation={"max_new_tokens": 1, "temperature": 1.0},
        learning_rate=0.004,
        lr_schedule="constant",
        **options,
    )
    module.teacher.model.load_state_dict(colour_teacher)
    assert module.teacher.sees_images
    data = ColourSquaresDataModule(num_prompts=48, num_val_prompts=24, tokenizer=module.tokenizer, batch_size=16)
    before = held_out_kl(module, data, tmp_path)
    quiet_trainer(tmp_path, max_epochs=EPOCHS[mode], num_sanity_val_steps=0, limit_val_batches=0).fit(module, data)
    after = held_out_kl(module, data, tmp_path)
    print(f"distillation ({mode}) from a VL teacher, held-out KL per token: {before} -> {after}")
    assert after["reverse_kl"] < 0.5 * before["reverse_kl"] and after["forward_kl"] < 0.5 * before["forward_kl"]


EPOCHS = {"full": 6, "sampled": 6}


def test_a_teacher_that_cannot_see_the_images_is_refused():
    module = DistillationModule(model_config={"preset": PRESET}, teacher_model_config={"preset": PRESET},
                                tokenizer_name=PRESET)  # fmt: skip
    module.check_sees_images(None)  # text rows: any teacher
    module.check_sees_images(object())
    module._teacher = [SimpleNamespace(token_logprobs=None)]  # a text or served teacher: no ``sees_images``
    with pytest.raises(ConfigError, match="the prompts carry images but the teacher is a text model"):
        module.check_sees_images(object())
