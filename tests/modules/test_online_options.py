"""The TRL options of the critic-free modules (scale_rewards, policy_loss: loss_type, importance_sampling_level,
delta, top_entropy_quantile, mask_truncated_completions) wired through ``CriticFreeModule``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import SAMPLER, TINY_LLAMA
from online_fixtures import EOS, TOY_REWARD, fixed_rollout_module

from aitraining_pl.errors import ConfigError, HyperparameterError
from aitraining_pl.losses import PolicyLossConfig, clipped_policy_loss, high_entropy_mask
from aitraining_pl.modules.critic_free import GRPOModule, RLOOModule

ROOT = Path(__file__).resolve().parents[2]


def _batch():
    ids = torch.tensor([[10, 11], [12, 13]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompts": ["a", "b"], "metadata": [{}, {}]}


def test_options_are_one_group_in_hparams_and_checked():
    module = GRPOModule(
        reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte", scale_rewards="batch",
        policy_loss={"loss_type": "cispo", "top_entropy_quantile": 0.2},
    )  # fmt: skip
    assert module.hparams.scale_rewards == "batch"
    assert module.hparams.policy_loss == {
        "loss_type": "cispo",
        "importance_sampling_level": "token",
        "delta": None,
        "top_entropy_quantile": 0.2,
        "mask_truncated_completions": False,
        "use_bias_correction_kl": False,
        "importance_sampling_mode": "auto",
        "importance_sampling_clip_min": None,
        "importance_sampling_clip_max": 3.0,
        "use_decoupled_loss": True,
    }
    assert module.policy_loss == PolicyLossConfig(loss_type="cispo", top_entropy_quantile=0.2)
    make = dict(reward=TOY_REWARD, model_config=TINY_LLAMA, tokenizer_name="byte")
    bad = [
        (dict(policy_loss={"loss_type": "ppo"}), r"GRPOModule.policy_loss.loss_type: unknown loss_type 'ppo'"),
        (dict(policy_loss={"importance_sampling_level": "row"}), "policy_loss.importance_sampling_level"),
        (dict(policy_loss={"delta": 1.0}), r"policy_loss.delta: must be > 1"),
        (dict(policy_loss={"top_entropy_quantile": 0.0}), "policy_loss.top_entropy_quantile"),
        (dict(scale_rewards="rows"), "GRPOModule.scale_rewards: unknown scale_rewards 'rows'"),
    ]
    for kwargs, message in bad:
        with pytest.raises(HyperparameterError, match=message):
            GRPOModule(**make, **kwargs)
    with pytest.raises(ConfigError, match="scale_rewards.*applies to advantage 'grpo', not 'rloo'"):
        RLOOModule(**make, scale_rewards="batch")
    with pytest.raises(ConfigError, match="policy_loss.delta.*cispo"):
        GRPOModule(**make, policy_loss={"loss_type": "cispo", "delta": 2.0})


def test_truncated_responses_leave_the_loss_and_batch_std_scales(monkeypatch):
    fixed = torch.tensor([[40, EOS], [41, EOS], [42, 43], [44, EOS]])  # row 2 hits max_new_tokens
    scores = [1.0, 0.0, 3.0, 1.0]
    module = fixed_rollout_module(
        monkeypatch, scores, fixed, num_generations=2, kl_coef=0.0, scale_rewards="batch",
        policy_loss=PolicyLossConfig(mask_truncated_completions=True),
    )  # fmt: skip
    rollout = module.rollout(_batch(), 2)
    experience, _ = module.make_experience(rollout)
    assert rollout.ended.tolist() == [True, True, False, True]
    assert experience.mask.sum(1).tolist() == [2, 2, 0, 2]
    batch_std = torch.tensor(scores).std().item()  # (r - group mean) / batch std; row 2 still counts in both
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0]) / (batch_std + 1e-4)
    torch.testing.assert_close(experience.advantages[:, 0], expected)


def test_top_entropy_quantile_weights_the_policy_term_of_the_minibatch(monkeypatch):
    fixed = torch.tensor([[40, 41, 42, EOS], [43, 44, 45, 46], [47, EOS, 0, 0], [48, 49, 50, 51]])
    kwargs = dict(num_generations=2, kl_coef=0.0, mini_batch_size=4)
    losses = {}
    for quantile in (1.0, 0.25):
        module = fixed_rollout_module(
            monkeypatch, [1.0, 0.0, 0.2, 0.7], fixed, policy_loss={"top_entropy_quantile": quantile}, **kwargs
        )
        experience, _ = module.make_experience(module.rollout(_batch(), 2))
        idx = torch.arange(4)
        losses[quantile], _ = module.minibatch_loss(experience, idx)
    out = module.response_scores(module.policy, experience.input_ids, experience.attention_mask, 2, True)
    weights = high_entropy_mask(out.entropy, experience.mask, 0.25)
    assert 0 < weights.sum() < experience.mask.sum()
    expected, _ = clipped_policy_loss(
        out.logprobs, out.logprobs.detach(), experience.advantages, experience.mask, 0.2, None, "sequence", 4,
        token_weights=weights,
    )  # fmt: skip
    assert losses[0.25].item() == pytest.approx(expected.item(), abs=1e-6)
    assert not math.isclose(losses[0.25].item(), losses[1.0].item(), abs_tol=1e-4)


def test_the_options_parse_from_the_command_line(capsys):
    from aitraining_pl.cli import main

    args = ["fit", "--config", str(ROOT / "configs/quickstart/grpo.yaml"), "--model.init_args.scale_rewards", "batch"]
    args += ["--model.init_args.policy_loss.importance_sampling_level", "sequence", "--print_config"]
    with pytest.raises(SystemExit):
        main(args)
    out = capsys.readouterr().out
    assert "scale_rewards: batch" in out and "importance_sampling_level: sequence" in out and "loss_type: clip" in out


def test_ppo_takes_the_token_level_options(monkeypatch):
    import aitraining_pl.rollout as rollout_module
    from aitraining_pl.modules.ppo import PPOModule
    from aitraining_pl.rollout import GenerationConfig

    make = dict(model_config=TINY_LLAMA, tokenizer_name="byte", reward=lambda p, r, m: [1.0, 0.0], mini_batch_size=2)
    with pytest.raises(ConfigError, match="policy_loss.importance_sampling_level"):
        PPOModule(**make, policy_loss={"importance_sampling_level": "sequence"})
    options = {"loss_type": "cispo", "top_entropy_quantile": 0.5, "mask_truncated_completions": True}
    module = PPOModule(**make, generation=GenerationConfig(max_new_tokens=2, top_p=1.0), policy_loss=options)
    fixed = torch.tensor([[40, EOS], [41, 42]])  # row 1 is cut at max_new_tokens
    monkeypatch.setattr(SAMPLER, lambda *a, **k: rollout_module.SampledTokens(fixed.clone()))
    experience, _ = module.make_experience(module.rollout(_batch(), 1))
    assert experience.mask.sum(1).tolist() == [2, 0]
    loss, stats = module.minibatch_loss(experience, torch.arange(2))
    out = module(experience.input_ids, experience.attention_mask, 2, with_entropy=True)
    weights = high_entropy_mask(out.entropy, experience.mask, 0.5)
    expected, _ = clipped_policy_loss(
        out.logprobs, experience.logprobs, experience.advantages, experience.mask, 0.2, None, "token",
        loss_type="cispo", token_weights=weights,
    )  # fmt: skip
    assert stats["policy_loss"].item() == pytest.approx(expected.item(), abs=1e-6) and torch.isfinite(loss)


def test_a_reference_copy_is_announced_once_where_it_is_loaded(caplog):
    """GRPO's default kl_coef 0.04 loads a second full model (TRL's default beta=0.0 loads none): one info line says
    so when the frozen copy is built; kl_coef 0 and LoRA (the base with adapters off) load no copy and say nothing."""
    from aitraining_pl.models import LoRAConfig

    common = {"reward": TOY_REWARD, "model_config": TINY_LLAMA, "tokenizer_name": "byte"}
    with caplog.at_level("INFO"):
        GRPOModule(**common)
    assert [r.getMessage() for r in caplog.records if "kl_coef=0.04 loads a frozen copy" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("INFO"):
        GRPOModule(**common, kl_coef=0.0)
        GRPOModule(**common, lora=LoRAConfig(r=4))
    assert not [r for r in caplog.records if "frozen copy" in r.getMessage()]
