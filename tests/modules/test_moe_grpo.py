"""GRPO and PPO on a mixture-of-experts policy (Qwen3-MoE, tiny, random) with routing replay
(``models.routing_replay``): the sampler's routes reach the policy and proximal (PPO: old log-prob and value) passes,
the router's auxiliary loss follows the config, and the GRPO policy learns."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from bandit import WORDS, next_token_distribution, word_tokenizer
from conftest import quiet_trainer

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.models import load_tokenizer
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.rollout import GenerationConfig

#: a Qwen3-MoE over the bandit's eight words: 4 experts, 2 per token, the config's load-balancing loss on
POLICY = {
    "model_type": "qwen3_moe",
    "vocab_size": len(WORDS),
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
    **dict.fromkeys(("eos_token_id", "pad_token_id", "bos_token_id"), 0),
}


def f_reward(prompts, responses, metadata) -> list[float]:
    """The share of ``f`` among a response's three words."""
    return [r.split().count("f") / 3 for r in responses]


@pytest.mark.slow
def test_grpo_learns_on_an_moe_policy_with_routing_replay(tmp_path):
    """Three-word responses (each fed back, so its route is recorded and replayed) rewarded by their share of
    ``f``; two passes per rollout (the proximal pass replays too). The probability of ``f`` after the prompt rises
    from about 1/8 to over 0.5; every minibatch logs ``routing/flip_rate`` (0 here: the sampler is the policy
    with the same weights) and ``routing/aux_loss``."""
    pl.seed_everything(0)
    folder = word_tokenizer(tmp_path / "tokenizer")
    module = GRPOModule(
        model_config=POLICY,
        tokenizer_name=folder,
        reward=f_reward,
        generation=GenerationConfig(max_new_tokens=3, temperature=1.0, top_p=1.0),
        num_generations=8,
        learning_rate=0.02,
        mini_batch_size=32,
        num_iterations=2,
    )
    tokenizer = load_tokenizer(folder)
    prompt = tokenizer("a", return_tensors="pt", add_special_tokens=False)["input_ids"]
    f = WORDS.index("f")
    before = next_token_distribution(module.policy, prompt)[f]
    seen = []
    frozen = module.frozen_logprobs
    module.frozen_logprobs = lambda rollout, reference: seen.append(rollout.routes) or frozen(rollout, reference)
    dm = PromptDataModule(prompts=["a"] * (4 * 30), tokenizer=tokenizer, batch_size=4)
    quiet_trainer(tmp_path, max_epochs=1).fit(module, dm)
    after = next_token_distribution(module.policy, prompt)[f]
    print(f"\nP(f | prompt): {float(before):.3f} before, {float(after):.3f} after")
    assert before < 0.2 and after > 0.5, (before, after)
    assert seen and all(r is not None and r.shape[2:] == (2, 2) for r in seen)
    stats = module.update_history[-1]
    assert stats["routing/flip_rate"] == 0 and stats["routing/aux_loss"] > 0


def test_ppo_replays_the_samplers_routes_in_both_passes(tmp_path):
    """PPO on the MoE policy: the old log-prob / value pass (eval mode) and each minibatch's pass get the rollout's
    routes (the sampler's, recorded by the HF decoder) and replay them; the step logs ``routing/flip_rate`` 0 (the
    sampler is the policy with the same weights) and ``routing/aux_loss`` (the config's load-balancing loss, added to
    the loss)."""
    from aitraining_pl.modules.ppo import PPOModule

    pl.seed_everything(0)
    folder = word_tokenizer(tmp_path / "tokenizer")
    module = PPOModule(
        model_config=POLICY,
        tokenizer_name=folder,
        reward=f_reward,
        generation=GenerationConfig(max_new_tokens=3, temperature=1.0, top_p=1.0),
        learning_rate=0.01,
        mini_batch_size=4,
        ppo_epochs=1,  # one minibatch, before the step: the policy is still the sampler
    )
    seen = []
    scores = module.scores
    routes_of = lambda args, kw: args[5] if len(args) > 5 else kw.get("routes")  # noqa: E731
    module.scores = lambda *args, **kw: seen.append((module.model.training, routes_of(args, kw))) or scores(*args, **kw)
    tokenizer = load_tokenizer(folder)
    dm = PromptDataModule(prompts=["a"] * 8, tokenizer=tokenizer, batch_size=4)
    quiet_trainer(tmp_path, max_steps=1).fit(module, dm)
    assert {training for training, _ in seen} == {False, True}
    assert all(routes is not None and routes.shape[2:] == (2, 2) for _, routes in seen)
    stats = module.update_history[-1]
    assert stats["routing/flip_rate"] == 0 and stats["routing/aux_loss"] > 0
