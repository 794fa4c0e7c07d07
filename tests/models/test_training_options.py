"""disable_dropout, gradient checkpointing on the packed path, the exactness probe's fallbacks, contiguity."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from architectures import WITH_DROPOUT, build_sharpened, spec
from conftest import TINY_LLAMA

import aitraining_pl.models.lm_head as lm_head
import aitraining_pl.models.scoring as scoring
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.losses import sequence_logps
from aitraining_pl.models import LoRAConfig, apply_lora, build_causal_lm
from aitraining_pl.models.scoring import can_pack, completion_logps, is_contiguous, scoring_path
from aitraining_pl.models.training import disable_dropout
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.modules.reward import RewardModule
from aitraining_pl.rollout import GenerationConfig

TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source

BATCH = {  # two pairs sharing their prompts, right padded, chosen rows first
    "input_ids": torch.tensor([[5, 6, 7, 1, 0, 0], [4, 3, 9, 0, 0, 0], [5, 6, 8, 9, 10, 1], [4, 3, 2, 8, 0, 0]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
    "completion_mask": torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]),
}


def _two_forwards(model, ids):
    model.train()
    return [model(input_ids=ids, use_cache=False).logits for _ in range(2)]


@pytest.mark.parametrize("model_type", [*WITH_DROPOUT, "falcon", "gpt_neox", "llama-lora"])
def test_disable_dropout_makes_training_forwards_identical(model_type):
    torch.manual_seed(0)
    if model_type == "llama-lora":  # dropout only in the adapters (peft's lora_dropout)
        model = apply_lora(build_causal_lm({**TINY_LLAMA, "attention_dropout": 0.0}), LoRAConfig(r=4, dropout=0.5))
        torch.nn.init.normal_(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight)
    else:
        model = build_sharpened(model_type, scale=1.0)
    ids = torch.randint(3, 90, (2, 9))
    first, second = _two_forwards(model, ids)
    assert not torch.allclose(first, second)  # the config's dropout is live in training mode
    disable_dropout(model)
    first, second = _two_forwards(model, ids)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(first, model(input_ids=ids, use_cache=False).logits, rtol=1e-6, atol=1e-6)


def test_modules_disable_dropout_by_default():
    gpt2 = {"model_type": "gpt2", **spec("gpt2"), "vocab_size": 384}
    lora = LoRAConfig(r=4, alpha=8, dropout=0.3)
    for flag in (True, False):
        dpo = DPOModule(model_config=gpt2, tokenizer_name="byte", lora=lora, disable_dropout=flag)
        dpo.train()
        logps = [completion_logps(dpo.policy, BATCH, True, True).logps.detach() for _ in range(2)]
        assert torch.equal(*logps) == flag
        # the implicit rewards are 0 at initialisation: policy (training mode) = reference (eval mode)
        if flag:
            torch.testing.assert_close(logps[0], dpo._reference_forward(BATCH), rtol=0, atol=1e-5)
        reward = RewardModule(model_config=gpt2, tokenizer_name="byte", dropout_prob=0.3, disable_dropout=flag)
        reward.train()
        scores = [reward.reward_model.score(BATCH["input_ids"], BATCH["attention_mask"]).detach() for _ in range(2)]
        assert torch.equal(*scores) == flag
        ppo = PPOModule(reward=TOY_REWARD, model_config=gpt2, tokenizer_name="byte", lora=lora, disable_dropout=flag)
        rates = [m.p for m in ppo.modules() if isinstance(m, torch.nn.Dropout)]
        assert (max(rates) == 0) == flag


def test_ppo_with_dropout_and_lora_starts_at_ratio_one(tmp_path, byte_tokenizer):
    """A dropout model under LoRA with adapter dropout: the first minibatch's ratio is 1 and nothing is
    clipped (old log-probs are computed in eval mode, the update in training mode)."""

    def run(flag):
        torch.manual_seed(0)
        module = PPOModule(
            model_config={"model_type": "gpt2", **spec("gpt2"), "vocab_size": 384, "eos_token_id": 1},
            tokenizer_name="byte",
            lora=LoRAConfig(r=4, alpha=8, dropout=0.3),
            disable_dropout=flag,
            reward=lambda prompts, responses, metadata: [float(len(r)) for r in responses],
            generation=GenerationConfig(max_new_tokens=6, temperature=1.0, top_p=1.0),
            learning_rate=1e-3,
            mini_batch_size=2,
            num_iterations=1,
            epsilon=0.01,
        )
        dm = PromptDataModule(prompts=["ab", "cde", "f", "ghij"], tokenizer=byte_tokenizer, batch_size=4)
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            limit_train_batches=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        ).fit(module, dm)
        return module.update_history[0]

    first = run(True)
    assert float(first["clipfrac"]) == 0.0
    assert abs(float(first["approx_kl"])) < 1e-7
    with_dropout = run(False)  # the same run keeping the model's dropout: ratios are off from the start
    assert float(with_dropout["clipfrac"]) > 0 and abs(float(with_dropout["approx_kl"])) > 1e-4


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4, alpha=8, dropout=0.0)], ids=["full", "lora"])
def test_gradient_checkpointing_on_the_packed_path(lora):
    """Packed DPO (shared prompt) gives the same loss and gradients with and without checkpointing; the
    recomputation in backward runs packed too (without it: CheckpointError)."""
    results = []
    for checkpointing in (False, True):
        module = DPOModule(
            model_config=TINY_LLAMA, tokenizer_name="byte", lora=lora, gradient_checkpointing=checkpointing
        )
        module.train()
        layers = module.policy.get_base_model().model.layers if lora else module.policy.model.layers
        assert all(layer.gradient_checkpointing == checkpointing for layer in layers)
        assert scoring_path(module.policy).name == "packed"
        loss = completion_logps(module.policy, BATCH, padding_free=True, share_prompt=True).logps.sum()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in module.policy.parameters() if p.requires_grad]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    for plain, checkpointed in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-5, atol=1e-6)


def test_unknown_logit_post_processing_falls_back_to_the_models_forward(monkeypatch, caplog):
    """A model whose forward changes logits in a way the head-only path does not know (Granite's scaling,
    with the explicit handling removed) is caught by the probe: its log-probs run through its own forward."""
    monkeypatch.setattr(lm_head, "head_logits", lambda head, config, hidden: head(hidden))
    monkeypatch.delitem(lm_head.LOGIT_SCALES, "granite")  # the chunked head's handling too
    model = build_sharpened("granite")
    with caplog.at_level("INFO", logger="aitraining_pl.models.scoring"):
        path = scoring_path(model)
    assert path.name == "forward" and "differs from the model's forward" in path.reason
    assert "GraniteForCausalLM: log-probs run on the forward path" in caplog.text
    batch = {k: v.clone() for k, v in BATCH.items()}
    want = sequence_logps(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
        batch["input_ids"],
        batch["completion_mask"],
    ).logps
    torch.testing.assert_close(completion_logps(model, batch, True, True).logps, want, rtol=0, atol=1e-4)


def test_probe_runs_once_per_model(monkeypatch):
    model = build_causal_lm(TINY_LLAMA)
    calls = []
    probe = scoring._probe
    monkeypatch.setattr(scoring, "_probe", lambda m: calls.append(1) or probe(m))
    for _ in range(3):
        completion_logps(model, BATCH, True, True)
    assert len(calls) == 1


def test_packing_needs_a_contiguous_completion_mask():
    assert is_contiguous(BATCH) and can_pack(BATCH, share_prompt=True)
    gap = {**BATCH, "completion_mask": BATCH["completion_mask"].clone()}
    gap["completion_mask"][2, 3] = 0  # prompt, completion, a hole, completion: not one run
    left = {k: v.flip(1) for k, v in BATCH.items()}  # left padded
    model = build_causal_lm(TINY_LLAMA)
    for batch in (gap, left):
        assert not is_contiguous(batch) and not can_pack(batch) and not can_pack(batch, share_prompt=True)
        want = sequence_logps(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
            batch["input_ids"],
            batch["completion_mask"],
        ).logps
        torch.testing.assert_close(completion_logps(model, batch, True, True).logps, want, rtol=0, atol=1e-5)


def test_probe_keeps_the_fast_path_under_bf16():
    """The probe compares in the parameters' dtype (autocast off): bf16-mixed training and bf16 weights
    keep the packed path on a Llama."""
    model = build_causal_lm(TINY_LLAMA)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert scoring_path(model).name == "packed"
    assert scoring_path(build_causal_lm(TINY_LLAMA, dtype="bfloat16")).name == "packed"


def test_gradient_checkpointing_in_reward_and_ppo_modules():
    """The reward trunk and PPO's policy recompute in backward with the same loss and gradients."""

    def reward_grads(checkpointing):
        module = RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", gradient_checkpointing=checkpointing)
        module.train()
        module.reward_model.score(BATCH["input_ids"], BATCH["attention_mask"]).sum().backward()
        assert module.reward_model.trunk.is_gradient_checkpointing == checkpointing
        return [p.grad for p in module.parameters() if p.requires_grad]

    def ppo_grads(checkpointing):
        torch.manual_seed(0)  # the value head's first layer initialises from the global generator
        module = PPOModule(
            reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", gradient_checkpointing=checkpointing
        )
        torch.nn.init.normal_(module.model.value_head.net[-1].weight, generator=torch.Generator().manual_seed(0))
        module.train()
        out = module(BATCH["input_ids"], BATCH["attention_mask"], 2, with_entropy=True)  # fused head: no logits
        (out.logprobs.sum() + out.entropy.sum() + out.values.sum()).backward()
        assert module.policy.is_gradient_checkpointing == checkpointing
        return [p.grad for p in module.parameters() if p.requires_grad]

    for grads in (reward_grads, ppo_grads):
        for plain, checkpointed in zip(grads(False), grads(True)):
            torch.testing.assert_close(plain, checkpointed, rtol=1e-5, atol=1e-6)
