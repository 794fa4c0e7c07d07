"""TR-DPO's reference updates (``SyncReferenceCallback``, ``ReferencePolicy.mix_in_policy``) for DPO and online RL."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer
from dpo_utils import preference_data, preference_rows

from aitraining_pl.callbacks.reference_sync import SyncReferenceCallback
from aitraining_pl.errors import ConfigError, HyperparameterError
from aitraining_pl.models import LoRAConfig, ReferencePolicy, build_causal_lm
from aitraining_pl.modules.dpo import DPOModule


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_mix_in_policy_is_the_soft_update_hand_values():
    policy = build_causal_lm(TINY_LLAMA, seed=1)
    reference = ReferencePolicy(policy, build_reference=lambda: build_causal_lm(TINY_LLAMA, seed=2))
    before, target = _params(reference.frozen_copy), _params(policy)
    reference.mix_in_policy(0.25)
    for name, param in reference.frozen_copy.named_parameters():
        torch.testing.assert_close(param, 0.25 * target[name] + 0.75 * before[name])
    reference.mix_in_policy(1.0)  # the hard update: a copy of the policy
    for name, param in reference.frozen_copy.named_parameters():
        torch.testing.assert_close(param, target[name])
    assert all(torch.equal(p, target[n]) for n, p in policy.named_parameters())  # the policy is untouched


class _Probe(pl.Callback):
    """After every batch (and after the sync callback): the step, the reference's and the policy's weights."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.seen.append((trainer.global_step, _params(pl_module.reference.frozen_copy), _params(pl_module.policy)))


def test_dpo_reference_moves_every_n_steps_and_not_otherwise(tmp_path, byte_tokenizer):
    module = DPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", learning_rate=1e-2, seed=0)
    data = preference_data(preference_rows(24), byte_tokenizer, batch_size=4, val_split=0.0)
    start = _params(module.reference.frozen_copy)
    sync, probe = SyncReferenceCallback(ref_model_mixup_alpha=0.5, ref_model_sync_steps=2), _Probe()
    quiet_trainer(tmp_path, max_steps=5, callbacks=[sync, probe]).fit(module, data)
    previous = start
    assert [step for step, _, _ in probe.seen] == [1, 2, 3, 4, 5]
    for step, reference, policy in probe.seen:
        for name, value in reference.items():
            expected = 0.5 * policy[name] + 0.5 * previous[name] if step % 2 == 0 else previous[name]
            torch.testing.assert_close(value, expected)
        previous = reference
    assert sync.syncs == 2
    assert any(not torch.equal(previous[n], start[n]) for n in start)  # it did move

    # the moved reference is in the callback's checkpoint state and comes back on resume
    state = sync.state_dict()
    fresh = DPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", seed=0)
    restored = SyncReferenceCallback(ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)
    restored.load_state_dict(state)
    restored.on_train_start(None, fresh)
    assert restored.syncs == 2
    for name, param in fresh.reference.frozen_copy.named_parameters():
        torch.testing.assert_close(param, previous[name])


def test_grpo_reference_moves_with_the_callback(tmp_path):
    from online_fixtures import QUICKSTART_PROMPTS, TOY_REWARD

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule

    module = GRPOModule(
        model_config=dict(TINY_LLAMA), tokenizer_name="byte", reward=TOY_REWARD, num_generations=2,
        mini_batch_size=4, generation={"max_new_tokens": 4}, learning_rate=1e-2, kl_coef=0.1,
    )  # fmt: skip
    data = PromptDataModule(data_path=QUICKSTART_PROMPTS, tokenizer=module.tokenizer, batch_size=2, val_split=0.0)
    start = _params(module.reference.frozen_copy)
    probe = _Probe()
    sync = SyncReferenceCallback(ref_model_mixup_alpha=0.5, ref_model_sync_steps=1)
    quiet_trainer(tmp_path, max_steps=1, callbacks=[sync, probe]).fit(module, data)
    (_, reference, policy), = probe.seen  # fmt: skip
    for name, value in reference.items():
        torch.testing.assert_close(value, 0.5 * policy[name] + 0.5 * start[name])


def test_sync_refuses_a_reference_it_cannot_move(tmp_path, byte_tokenizer):
    data = preference_data(preference_rows(8), byte_tokenizer, batch_size=4, val_split=0.0)
    cases = [
        (dict(lora=LoRAConfig(r=2)), "under LoRA"),
        (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs"),
        (dict(reference_free=True), "no reference model"),
    ]
    for kwargs, message in cases:
        module = DPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", **kwargs)
        trainer = quiet_trainer(tmp_path, max_steps=1, callbacks=[SyncReferenceCallback(ref_model_sync_steps=1)])
        with pytest.raises(ConfigError, match=message):
            trainer.fit(module, data)
    with pytest.raises(HyperparameterError, match="ref_model_mixup_alpha"):
        SyncReferenceCallback(ref_model_mixup_alpha=0.0)
    with pytest.raises(HyperparameterError, match="ref_model_sync_steps"):
        SyncReferenceCallback(ref_model_sync_steps=0)


def test_ppo_reference_mixes_in_the_policy_under_its_value_head_wrapper():
    from online_fixtures import TOY_REWARD

    from aitraining_pl.modules.ppo import PPOModule

    module = PPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", reward=TOY_REWARD)
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.01)
    module.reference.mix_in_policy(1.0)
    policy = dict(module.policy.named_parameters())
    for name, param in module.reference.frozen_copy.named_parameters():
        torch.testing.assert_close(param, policy[name])
