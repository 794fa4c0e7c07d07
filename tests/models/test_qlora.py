"""QLoRA: 4-bit base weights through bitsandbytes (CPU ``Linear4bit`` forward and backward), adapters on top."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA as _TINY
from conftest import quiet_trainer
from dpo_utils import preference_data, preference_rows

from aitraining_pl.errors import ConfigError
from aitraining_pl.models import LoRAConfig, build_causal_lm
from aitraining_pl.models.scoring import completion_logps
from aitraining_pl.modules.dpo import DPOModule

bnb = pytest.importorskip("bitsandbytes")

# Every linear layer's input size a multiple of bitsandbytes' 64-weight quantization block: on an AMD EPYC with
# AVX512-BF16 (2026-12-02), bitsandbytes 0.50 quantizes rows shorter than a block wrongly (a 32x32 NF4 round trip
# has a relative error of 0.37 there, 0.09 from 64 columns up), which no real model's layer meets.
TINY_LLAMA = {**_TINY, "hidden_size": 64, "intermediate_size": 128}

QUANT = {"load_in_4bit": True, "quant_type": "nf4", "compute_dtype": "float32"}
LORA = LoRAConfig(r=4, alpha=8, dropout=0.0)


def _load_live_weights(peft_base, target):
    """Copy into ``target`` (the exported full-precision model's trunk) each 4-bit layer of ``peft_base``
    dequantized, plus its adapter's delta: then ``target`` holds exactly the weights the live QLoRA model computes
    with, so the two must agree to float rounding (the export path: head, pooling, names, everything but the
    4-bit rounding of the base it merged into)."""
    import bitsandbytes.functional as F

    with torch.no_grad():
        for name, layer in peft_base.named_modules():
            if isinstance(layer, bnb.nn.Linear4bit):
                owner = name.removesuffix(".base_layer")
                delta = peft_base.get_submodule(owner).get_delta_weight("default")
                weight = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
                target.get_submodule(owner).weight.copy_(weight + delta)


def _module(**kwargs):
    return DPOModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", lora=LORA, quantization=QUANT, learning_rate=1e-2, **kwargs
    )


def _batch(module):
    data = preference_data(preference_rows(8), module.tokenizer, val_split=0, batch_size=8)
    data.setup("fit")
    return next(iter(data.train_dataloader())), data


def test_qlora_policy_has_4bit_layers_trains_only_adapters_and_its_reference_is_the_4bit_base(tmp_path):
    module = _module()
    policy = module.policy
    linear4 = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 7 * TINY_LLAMA["num_hidden_layers"]  # q, k, v, o, gate, up, down in every layer
    assert all(m.weight.dtype == torch.uint8 for m in linear4)
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert module.hparams.quantization == {**QUANT, "double_quant": False}
    batch, data = _batch(module)
    # the reference is the policy with adapters off, not a second (full-precision) copy
    assert module.reference.shares_weights
    with torch.no_grad(), policy.disable_adapter():
        base = completion_logps(policy.eval(), batch).logps
    torch.testing.assert_close(module._reference_forward(batch), base)
    # training: the loss falls, the adapters move, the 4-bit weights and the reference stay
    frozen = [m.weight.data.clone() for m in linear4]
    trainer = quiet_trainer(tmp_path, max_steps=12, log_every_n_steps=1)
    losses = []

    class Record(__import__("lightning").pytorch.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(module, data)
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    assert all(torch.equal(m.weight.data, w) for m, w in zip(linear4, frozen))
    torch.testing.assert_close(module._reference_forward(batch), base)
    assert not torch.allclose(completion_logps(policy.eval(), batch).logps, base)


def test_qlora_needs_lora():
    with pytest.raises(ConfigError, match="set lora too"):
        DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", quantization=QUANT)
    from aitraining_pl.modules.reward import RewardModule

    with pytest.raises(ConfigError, match="set lora too"):
        RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", quantization=QUANT)
    off = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", quantization={**QUANT, "load_in_4bit": False})
    assert off.hparams.quantization is None and not any(isinstance(m, bnb.nn.Linear4bit) for m in off.modules())


def test_qlora_export_merges_into_the_full_precision_base(tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    module = _module()
    torch.manual_seed(0)
    for name, p in module.policy.named_parameters():  # adapters away from 0, as after training
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    module.save_pretrained(tmp_path / "merged", merge_lora=True)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    full = build_causal_lm(TINY_LLAMA, seed=0)  # the full-precision weights the 4-bit model was loaded from
    layer = module.policy.get_base_model().model.layers[0].self_attn.q_proj
    expected = full.model.layers[0].self_attn.q_proj.weight + layer.get_delta_weight("default")
    got = merged.model.layers[0].self_attn.q_proj.weight
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.detach())
    torch.testing.assert_close(merged.model.embed_tokens.weight, full.model.embed_tokens.weight)
    # with the 4-bit rounding of the base put into its weights, the merged model computes what the live policy does
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        exported = merged(input_ids=ids).logits
        _load_live_weights(module.policy.get_base_model().model, merged.model)
        torch.testing.assert_close(merged(input_ids=ids).logits, module.policy.eval()(input_ids=ids).logits)
    # adapters only: they load onto the full-precision base written beside them
    module.save_pretrained(tmp_path / "adapters")
    assert (tmp_path / "adapters" / "base" / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((tmp_path / "adapters" / "base" / "config.json").read_text())
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapters").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, exported, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ online RL
def _online(cls, **kwargs):
    from aitraining_pl.rollout import GenerationConfig

    return cls(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        lora=LORA,
        quantization=QUANT,
        reward=lambda p, r, m: [float(sum(c.islower() for c in x)) for x in r],
        generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        learning_rate=1e-2,
        num_iterations=2,
        **{"mini_batch_size": 4, **kwargs},
    )


@pytest.mark.parametrize("name", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_qlora_online_policy_trains_adapters_and_its_reference_is_the_4bit_base(tmp_path, byte_tokenizer, name):
    """GRPO and PPO on a 4-bit policy: Linear4bit layers, only adapters (+ PPO's value head) trainable, one
    iteration moves the adapters and the policy's log-probs while the reference (adapters off) stays."""
    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.modules.ppo import PPOModule

    module = _online(GRPOModule, num_generations=4) if name == "grpo" else _online(PPOModule, mini_batch_size=2)
    policy = module.policy
    linear4 = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 7 * TINY_LLAMA["num_hidden_layers"]
    assert module.hparams.quantization == {**QUANT, "double_quant": False}
    assert module.reference.shares_weights
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "value_head" in n for n in trainable), trainable
    ids = torch.tensor([[97, 98, 99, 100, 101, 102]])
    with torch.no_grad():
        ref_before = module.reference(ids).clone()
        policy_before = policy.eval()(input_ids=ids).logits.clone()
    torch.testing.assert_close(ref_before, policy_before)  # adapters start at zero
    lora = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    frozen = [m.weight.data.clone() for m in linear4]
    dm = PromptDataModule(prompts=["ab", "cd", "ef", "gh"], tokenizer=byte_tokenizer, batch_size=2)
    trainer = quiet_trainer(tmp_path, limit_train_batches=2)
    trainer.fit(module, dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert trainer.global_step > 0
    named = dict(policy.named_parameters())
    assert any(not torch.equal(named[n], p) for n, p in lora.items())
    assert all(torch.equal(m.weight.data, w) for m, w in zip(linear4, frozen))
    with torch.no_grad():
        torch.testing.assert_close(module.reference(ids), ref_before)
        assert not torch.allclose(policy.eval()(input_ids=ids).logits, policy_before)


# ------------------------------------------------------------------------------------------------ reward models
def test_qlora_reward_model_trains_adapters_and_head_and_exports_in_full_precision(tmp_path):
    """The reward model's trunk in 4 bits with LoRA adapters, the head in full precision: only adapters and
    head train, the Bradley-Terry loss falls, and the export (adapters merged into the full-precision trunk)
    loads in plain transformers."""
    from transformers import AutoModelForSequenceClassification

    from aitraining_pl.models import load_backbone
    from aitraining_pl.modules.reward import RewardModule

    module = RewardModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", lora=LORA, quantization=QUANT, learning_rate=1e-2,
        warmup_ratio=0.0, lr_schedule="constant",
    )  # fmt: skip
    model = module.reward_model
    linear4 = [m for m in model.trunk.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 7 * TINY_LLAMA["num_hidden_layers"]
    assert model.head.weight.dtype == torch.float32 and not isinstance(model.head, bnb.nn.Linear4bit)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert any(n.startswith("reward_model.head.") for n in trainable)
    assert all("lora_" in n or n.startswith("reward_model.head.") for n in trainable), trainable
    data = preference_data(preference_rows(8), module.tokenizer, val_split=0, batch_size=8)
    frozen = [m.weight.data.clone() for m in linear4]
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    losses = []

    class Record(__import__("lightning").pytorch.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = quiet_trainer(tmp_path, max_epochs=6, max_steps=6, log_every_n_steps=1, callbacks=[Record()])
    trainer.fit(module, data)
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    assert all(torch.equal(m.weight.data, w) for m, w in zip(linear4, frozen))
    named = dict(model.named_parameters())
    assert any(not torch.equal(named[n], p) for n, p in lora.items())
    # export: a plain sequence-classification model, the adapters merged into the full-precision trunk
    module.save_pretrained(tmp_path / "rm")
    assert "quantization_config" not in json.loads((tmp_path / "rm" / "config.json").read_text())
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    full = load_backbone(model_config=TINY_LLAMA, seed=0)
    layer = model.trunk.get_base_model().layers[0].self_attn.q_proj
    expected = full.layers[0].self_attn.q_proj.weight + layer.get_delta_weight("default")
    torch.testing.assert_close(exported.model.layers[0].self_attn.q_proj.weight, expected.detach())
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 2]])
    _load_live_weights(model.trunk.get_base_model(), exported.model)
    with torch.no_grad():
        live = model.eval().score(ids, torch.ones_like(ids))
        plain = exported(input_ids=ids).logits[:, 0]
    # the standard layout's head has no bias: the bias is the recorded constant offset (test_standard_exports.py)
    torch.testing.assert_close(plain + model.head.bias.detach(), live)


def test_reward_model_source_can_hold_its_trunk_in_4_bits(tmp_path):
    """A reward-model folder loaded as an online run's reward source with ``quantization``: 4-bit trunk, the
    head as saved, rewards close to the full-precision ones."""
    from aitraining_pl.models import RewardModel, RewardModelConfig
    from aitraining_pl.models.reward_sources import RewardModelSource

    model = RewardModel(RewardModelConfig(model_config=TINY_LLAMA, tokenizer_name="byte", dropout_prob=0.0))
    model.save_pretrained(tmp_path / "rm", tokenizer=model.get_tokenizer())
    full = RewardModelSource(str(tmp_path / "rm"))
    small = RewardModelSource(str(tmp_path / "rm"), quantization=QUANT)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in small.model.trunk.modules())
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in full.model.modules())
    torch.testing.assert_close(small.model.head.weight, full.model.head.weight)
    responses = ["abc", "hello there", "XYZ!", "a longer answer here"]
    exact, rounded = (
        torch.tensor(full([""] * 4, responses, [{}] * 4)),
        torch.tensor(small([""] * 4, responses, [{}] * 4)),
    )
    assert not torch.equal(exact, rounded)
    assert (exact - rounded).abs().max() < 0.25 * (1 + exact.abs().max()), (exact, rounded)
