"""Critic-free online RL (GRPO, Dr. GRPO, RLOO, REINFORCE++): packed log-probs, module structure, learning."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer
from online_fixtures import EOS, QUICKSTART_PROMPTS, TOY_REWARD, fixed_rollout_module

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.modules.critic_free import CriticFreeModule, GRPOModule, RLOOModule
from aitraining_pl.modules.online import OnlineRLModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.rollout import GenerationConfig


def _rollout_rows():
    """Left-padded prompts of different lengths, responses that end early, at once or never."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 300, (4, 10), generator=g)
    attention = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
            [0, 1, 1, 1, 1, 1, 1, 1, 0, 0],
        ]
    )
    return ids, attention, 4  # prompt length P = 4


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt_neox"])
def test_packed_and_padded_log_probs_and_gradients_are_equal(model_type, shared):
    """Also with rows that answer one prompt (``shared``: rows 0-1 and 2-3, packed with each prompt once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**TINY_LLAMA, "model_type": model_type}
    if model_type == "gpt_neox":
        config.update(rotary_pct=1.0, use_parallel_residual=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa")
    ids, attention, P = _rollout_rows()
    if shared:
        ids[1, :P], attention[1, :P], ids[3, :P], attention[3, :P] = (
            ids[0, :P],
            attention[0, :P],
            ids[2, :P],
            attention[2, :P],
        )
    results = []
    for padding_free in (True, False):
        model.zero_grad()
        out = response_logps(model, ids, attention, P, temperature=0.7, padding_free=padding_free, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        results.append((out.logprobs.detach(), out.entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    mask = attention[:, P:].bool()
    assert torch.all(lp_a[~mask] == 0) and torch.all(lp_a[mask] < 0)
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(ent_a, ent_b, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, atol=1e-5)
    # and both equal a plain full forward with log_softmax
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, P - 1 : -1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1) * mask
    assert torch.allclose(lp_a, expected, atol=1e-5)


def test_family_shares_one_base_and_presets_set_defaults():
    assert issubclass(PPOModule, OnlineRLModule) and issubclass(GRPOModule, OnlineRLModule)
    for name in ("training_step", "update", "rollout", "log_iteration", "validation_step"):
        assert name not in vars(PPOModule) and name not in vars(CriticFreeModule), name
    grpo = GRPOModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", num_generations=4)
    rloo = RLOOModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", num_generations=4)
    assert (grpo.hparams.advantage, grpo.hparams.loss_aggregation, grpo.hparams.kl_in_reward) == (
        "grpo",
        "sequence",
        False,
    )
    assert (rloo.hparams.advantage, rloo.hparams.loss_aggregation, rloo.hparams.kl_in_reward) == ("rloo", "token", True)
    assert grpo.hparams.num_generations == 4 and grpo.hparams.generation["max_new_tokens"] == 128
    with pytest.raises(ValueError, match="critic"):
        CriticFreeModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", advantage="gae")
    with pytest.raises(ValueError, match="unknown advantage"):
        CriticFreeModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", advantage="nope")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        CriticFreeModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", loss_aggregation="nope")


def test_kl_coef_zero_holds_no_reference():
    with_ref = GRPOModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", kl_coef=0.04)
    without = GRPOModule(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", kl_coef=0.0)
    assert without.reference is None and with_ref.reference is not None
    # no second copy of the weights anywhere on the module
    tensors = {id(t) for t in vars(without).values() if isinstance(t, torch.Tensor)}
    params = sum(p.numel() for p in without.parameters())
    assert params == sum(p.numel() for p in build_causal_lm(TINY_LLAMA).parameters()) and not tensors
    assert with_ref.reference.model is not with_ref.model


def test_one_grpo_step_matches_a_hand_written_update(tmp_path, monkeypatch, byte_tokenizer):
    """num_iterations = 1, no KL: one SGD-like AdamW step on -mean_i mean_t A_i * rho_it with rho = 1."""
    fixed = torch.tensor([[40, 41, EOS, 0], [EOS, 0, 0, 0], [50, 51, 52, 53], [60, EOS, 70, 71]])
    scores = [1.0, 0.0, 0.5, 0.5]
    module = fixed_rollout_module(
        monkeypatch,
        scores,
        fixed,
        num_generations=2,
        kl_coef=0.0,
        mini_batch_size=4,
        learning_rate=1e-2,
        max_grad_norm=0.0,
    )
    policy = copy.deepcopy(module.policy)
    initial = module.policy.lm_head.weight.detach().clone()
    dm = PromptDataModule(prompts=["hello", "a longer prompt"], tokenizer=byte_tokenizer, batch_size=2)
    quiet_trainer(tmp_path, limit_train_batches=1).fit(module, dm)
    # by hand: group 0 = rows 0, 1 (scores 1, 0), group 1 = rows 2, 3 (0.5, 0.5: no signal)
    dm.setup()
    batch = dm.collate_fn([dm.train_dataset[i] for i in range(2)])
    prompt_ids = batch["input_ids"].repeat_interleave(2, 0)
    prompt_mask = batch["attention_mask"].repeat_interleave(2, 0)
    resp_mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    ids, attn = torch.cat([prompt_ids, fixed], 1), torch.cat([prompt_mask, resp_mask], 1)
    P = prompt_ids.shape[1]
    a = 0.5 / (2**-0.5 + 1e-4)
    adv = torch.tensor([a, -a, 0.0, 0.0])
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    logits = policy(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, P - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, fixed[..., None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    loss = torch.stack([-(adv[i] * ratio[i, : int(resp_mask[i].sum())]).mean() for i in range(4)]).mean()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0)
    loss.backward()
    optimizer.step()
    assert module.update_history[0]["loss"].item() == pytest.approx(loss.item(), abs=1e-6)
    assert (module.policy.lm_head.weight - initial).abs().max() > 5e-3  # a real step was taken
    for (name, p), q in zip(module.policy.named_parameters(), policy.parameters()):
        assert torch.allclose(p, q, atol=1e-4), name  # AdamW's first step divides tiny gradients by their size


def test_dynamic_sampling_drops_groups_without_signal(monkeypatch):
    fixed = torch.tensor([[40, EOS], [41, EOS], [42, EOS], [43, 44]])
    module = fixed_rollout_module(
        monkeypatch,
        [1.0, 0.0, 0.5, 0.5],
        fixed,
        num_generations=2,
        kl_coef=0.0,
        dynamic_sampling=True,
        num_iterations=2,
    )
    ids = torch.tensor([[10, 11], [12, 13]])
    rollout = module.rollout(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompts": ["a", "b"], "metadata": [{}, {}]}, 2
    )
    experience, _ = module.make_experience(rollout)
    assert rollout.group.tolist() == [0, 0, 1, 1]
    assert experience.mask[:2].sum() == 4 and experience.mask[2:].sum() == 0
    assert experience.old_logprobs is not None and experience.ref_logprobs is None  # num_iterations > 1, no KL


def test_lora_grpo_under_bf16_mixed_with_reference_as_disabled_adapters(tmp_path, byte_tokenizer):
    """One GRPO iteration (two passes) with LoRA under bf16-mixed: adapters train, base weights (the reference)
    stay put, the packed passes run under autocast, metrics are finite."""
    from aitraining_pl.models import LoRAConfig

    module = GRPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        lora=LoRAConfig(r=4, alpha=8, dropout=0.0),
        reward=lambda p, r, m: [float(sum(map(ord, x)) % 5) for x in r],
        num_generations=4,
        num_iterations=2,
        generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        learning_rate=1e-2,
        mini_batch_size=4,
    )
    assert module.reference.shares_weights
    named = dict(module.model.named_parameters())
    lora = {n: p.detach().clone() for n, p in named.items() if "lora_B" in n}
    base = {n: p.detach().clone() for n, p in named.items() if "base_layer" in n}
    dm = PromptDataModule(prompts=["ab", "cd"], tokenizer=byte_tokenizer, batch_size=2)
    trainer = quiet_trainer(tmp_path, precision="bf16-mixed", limit_train_batches=1)
    trainer.fit(module, dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert trainer.global_step == 4  # 2 passes x 8 rollouts / 4 per minibatch
    named = dict(module.model.named_parameters())
    assert any(not torch.equal(named[n], p) for n, p in lora.items())
    assert all(torch.equal(named[n], p) for n, p in base.items())


# ------------------------------------------------------------------------------------------------ learning
ALGORITHMS = {
    "grpo": dict(cls=GRPOModule),
    "dr_grpo": dict(cls=GRPOModule, advantage="dr_grpo", loss_aggregation="constant", learning_rate=3e-2),
    "dapo": dict(cls=GRPOModule, loss_aggregation="token", epsilon_high=0.28, dynamic_sampling=True, kl_coef=0.0),
    "rloo": dict(cls=RLOOModule, num_iterations=2),
    "reinforce_pp": dict(cls=RLOOModule, advantage="reinforce_pp"),
    # two passes, so the ratio leaves 1 and the sequence-level / CISPO terms differ from GRPO's
    "gspo": dict(
        cls=GRPOModule, num_iterations=2, scale_rewards="batch", policy_loss={"importance_sampling_level": "sequence"}
    ),
    "cispo": dict(
        cls=GRPOModule, num_iterations=2, epsilon_high=4.0, loss_aggregation="token", policy_loss={"loss_type": "cispo"}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_learns_and_reference_stays(tmp_path, byte_tokenizer, name):
    """The quickstart reward (share of lowercase letters) rises on 16 held-out prompts."""
    pl.seed_everything(0)
    spec = dict(ALGORITHMS[name])
    cls = spec.pop("cls")
    kwargs = {"learning_rate": 1e-2, "mini_batch_size": 16, "num_generations": 4, **spec}
    module = cls(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        generation=GenerationConfig(max_new_tokens=8, temperature=1.0, top_p=1.0),
        **kwargs,
    )
    dm = PromptDataModule(data_path=QUICKSTART_PROMPTS, tokenizer=byte_tokenizer, batch_size=8, val_split=0.2)
    initial = module.policy.lm_head.weight.detach().clone()
    (before,) = quiet_trainer(tmp_path).validate(module, dm, verbose=False)
    trainer = quiet_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, dm)
    after = float(trainer.callback_metrics["val/reward_mean"])
    assert after > before["val/reward_mean"] + 0.15, (before, after)
    assert not torch.equal(initial, module.policy.lm_head.weight)
    if module.reference is None:
        assert module.hparams.kl_coef == 0
    else:
        assert torch.equal(module.reference.model.lm_head.weight, initial)  # the reference does not move
        assert all(not k.startswith("reference") for k in module.state_dict())
    metrics = trainer.callback_metrics
    for key in (
        "reward_mean",
        "reward_std",
        "frac_reward_zero_std",
        "completion_length",
        "completion_length/min",
        "completion_length/max",
        "clipped_ratio",
        "entropy",
        "clipfrac/low",
        "clipfrac/high",
        "lr",
    ):
        assert f"train/{key}" in metrics, key
    assert ("train/kl" in metrics) == bool(module.kl_coef)


def test_quickstart_config_runs_through_the_cli(tmp_path):
    """configs/quickstart/grpo.yaml: two GRPO iterations through ``aitraining-pl fit``, CSV metrics and export."""
    import csv
    from pathlib import Path

    import yaml

    from aitraining_pl.cli import main

    root = Path(__file__).resolve().parents[2]
    config = yaml.safe_load((root / "configs/quickstart/grpo.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "export")
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    main(
        [
            "fit",
            "--config",
            str(tmp_path / "grpo.yaml"),
            "--data.init_args.data_path",
            str(root / "aitraining_pl/data/quickstart_prompts.jsonl"),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.val_check_interval",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
        ]
    )
    (metrics,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    train = [r for r in rows if r.get("train/reward_mean")]
    assert len(train) == 2 and all(r.get("train/frac_reward_zero_std") for r in train)
    assert any(r.get("val/reward_mean") for r in rows)
    assert (tmp_path / "export").exists()


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp"])
def test_kl_regularised_bandit_reaches_the_closed_form_optimum(tmp_path, advantage):
    """RLOO and REINFORCE++ on the one-token bandit (``tests/helpers/bandit.py``) end within total variation 0.05 of
    ``pi* = pi_ref exp(r / beta) / Z`` (0.36 away at the start). That closed form is the optimum of
    ``E[r] - beta KL(pi || pi_ref)`` with the reverse KL, which is what the k1 estimator in the reward
    (``kl_in_reward``, ``log pi - log pi_ref`` of the sampled token) estimates without bias; other estimators
    or the KL in the loss have other fixed points under sampling. The ``vllm`` backend's run is in
    ``test_vllm_training.py``."""
    from bandit import train_bandit

    policy, optimum = train_bandit(tmp_path, advantage, backend="hf")
    assert 0.5 * (policy - optimum).abs().sum() < 0.05, (policy, optimum)
