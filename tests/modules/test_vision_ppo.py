"""PPO with images on a tiny random Qwen2-VL: the value head reads the VL policy's language model in the same pass as
the log-probs (both equal the model's own forward with the pixel values), an iteration trains the language model and
the value head and leaves the frozen vision tower alone; ``freeze_vision_tower`` is a constructor argument of the
modules."""

from __future__ import annotations

import pytest
import torch
from conftest import quiet_trainer

from aitraining_pl.datamodules.colours import ColourSquaresDataModule
from aitraining_pl.models.vision import model_inputs, vision_tower
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.modules.sft import SFTModule

PRESET = "tiny-qwen2-vl"
REWARD = "aitraining_pl.datamodules.colours:colour_reward"


def ppo(**options) -> PPOModule:
    options = {"reward": REWARD, **options}
    return PPOModule(model_config={"preset": PRESET}, tokenizer_name=PRESET,
                     generation={"max_new_tokens": 3, "temperature": 1.0}, **options)  # fmt: skip


def test_values_and_logprobs_with_images_equal_the_models_forward():
    torch.manual_seed(0)
    module = ppo()
    torch.nn.init.normal_(module.model.value_head.net[-1].weight)  # non-zero values
    data = ColourSquaresDataModule(num_prompts=4, num_val_prompts=0, tokenizer=module.tokenizer, batch_size=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rollout = module.rollout(batch, 2)
    ids, attention, P, vision = rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rollout.vision
    assert len(vision.prompts) == 4 and len(vision) == 8  # each prompt's pixel values once for its 2 samples
    with torch.no_grad():
        got = module(ids, attention, P, vision=vision)
        out = module.policy(**model_inputs(module.policy, ids, attention, vision), output_hidden_states=True)
    response = attention[:, P:].bool()
    logits = out.logits[:, P - 1 : -1].float().log_softmax(-1)
    want_logps = logits.gather(-1, ids[:, P:, None])[..., 0] * response
    want_values = module.model.value_head(out.hidden_states[-1][:, P - 1 : -1]) * response
    torch.testing.assert_close(got.logprobs, want_logps, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.values, want_values, atol=1e-5, rtol=1e-4)
    assert got.values[response].abs().min() > 0


def test_ppo_iteration_with_images_trains_the_language_model_and_value_head_not_the_tower(tmp_path):
    signal = lambda prompts, responses, metadata: [float(i % 3 == 0) for i in range(len(responses))]  # noqa: E731
    module = ppo(reward=signal, learning_rate=0.01, mini_batch_size=4, num_iterations=1)
    data = ColourSquaresDataModule(num_prompts=4, num_val_prompts=0, tokenizer=module.tokenizer, batch_size=4)
    tower = {k: v.clone() for k, v in vision_tower(module.policy).state_dict().items()}
    language = {k: v.clone() for k, v in module.policy.model.language_model.state_dict().items()}
    head = {k: v.clone() for k, v in module.model.value_head.state_dict().items()}
    quiet_trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module, data)
    assert all(torch.equal(v, vision_tower(module.policy).state_dict()[k]) for k, v in tower.items())
    after = module.policy.model.language_model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in language.items())
    assert any(not torch.equal(v, module.model.value_head.state_dict()[k]) for k, v in head.items())
    assert module.update_history and all(torch.isfinite(h["value_loss"]) for h in module.update_history)


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: GRPOModule(model_config={"preset": PRESET}, tokenizer_name=PRESET, reward=REWARD, **kw),
        lambda **kw: ppo(**kw),
        lambda **kw: SFTModule(model_config={"preset": PRESET}, tokenizer_name=PRESET, **kw),
        lambda **kw: DPOModule(model_config={"preset": PRESET}, tokenizer_name=PRESET, **kw),
    ],
    ids=["grpo", "ppo", "sft", "dpo"],
)
def test_freeze_vision_tower_is_a_constructor_argument(build):
    frozen, trained = build(), build(freeze_vision_tower=False)
    assert frozen.hparams.freeze_vision_tower is True and trained.hparams.freeze_vision_tower is False
    assert not any(p.requires_grad for p in vision_tower(frozen.policy).parameters())
    assert all(p.requires_grad for p in vision_tower(trained.policy).parameters())
