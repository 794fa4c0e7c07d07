"""GRPO on a tiny random Qwen2-VL with prompts that carry images (the colour-squares task,
``datamodules.colours``): rollouts sampled with the images, the log-prob passes with each row's images, the
language model trained and the frozen vision tower unchanged."""

from __future__ import annotations

import torch
from conftest import quiet_trainer

from aitraining_pl.datamodules.colours import ColourSquaresDataModule, colour_reward
from aitraining_pl.models.vision import vision_tower
from aitraining_pl.modules.critic_free import GRPOModule


def test_grpo_iteration_with_images_trains_the_language_model_only(tmp_path):
    module = GRPOModule(
        model_config={"preset": "tiny-qwen2-vl"},
        tokenizer_name="tiny-qwen2-vl",
        reward=lambda prompts, responses, metadata: [float(i % 3 == 0) for i in range(len(responses))],  # a signal
        generation={"max_new_tokens": 2, "temperature": 1.0},
        num_generations=4,
        learning_rate=0.01,
        mini_batch_size=8,
        kl_coef=0.04,
    )
    data = ColourSquaresDataModule(num_prompts=4, num_val_prompts=0, tokenizer=module.tokenizer, batch_size=2)
    tower = {k: v.clone() for k, v in vision_tower(module.policy).state_dict().items()}
    language = {k: v.clone() for k, v in module.policy.model.language_model.state_dict().items()}
    quiet_trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module, data)
    assert all(torch.equal(v, vision_tower(module.policy).state_dict()[k]) for k, v in tower.items())
    after = module.policy.model.language_model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in language.items())
    assert module.update_history and all(torch.isfinite(h["loss"]) for h in module.update_history)


def test_colour_reward():
    metadata = [{"colour": "red"}, {"colour": "green"}, {"colour": "blue"}]
    assert colour_reward(["colour?"] * 3, ["r", " b", "x"], metadata) == [1.0, 0.0, 0.0]
