"""Multi-turn episodes: the KV cache kept across turns (same draws as re-prefilling, only new tokens prefilled),
exact masks (no gradient through environment tokens, log-probs of a plain per-turn forward), one-turn episodes
equal to the single-response path, GAE / REINFORCE++ across holes, and GRPO learning the guessing game."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA
from episode_fixtures import SECRETS, episode_module, fit_on_the_game, held_out_success

from aitraining_pl.environments.chat import ChatFormat
from aitraining_pl.environments.episode import EpisodeEnvironment, EpisodeStep, OneTurnEpisode
from aitraining_pl.environments.episode_rollout import sample_episodes
from aitraining_pl.environments.multiturn import GuessingGame
from aitraining_pl.losses import clipped_policy_loss, gae, selective_log_softmax
from aitraining_pl.losses.advantages import reinforce_pp_advantages
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.rollout import GenerationConfig, RolloutEngine


def _model(seed: int = 0):
    return build_causal_lm(dict(TINY_LLAMA), seed=seed).eval()


def _prompts(tokenizer, texts=("Guess 1-7:", "Go", "Guess!")):
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return list(texts), ids, mask


class Chatter(EpisodeEnvironment):
    """Answers every turn with a reply of a length set by the turn, until 4 turns; reward per turn."""

    def reset(self, prompt, metadata):
        return None

    def step(self, turn):
        return EpisodeStep([{"role": "user", "content": "ok" * (1 + turn.index)}], reward=0.5 * turn.index)


def _episodes(tokenizer, env, samples=2, reprefill=False, max_new_tokens=5, seed=0):
    prompts, ids, mask = _prompts(tokenizer)
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0))
    torch.manual_seed(seed)
    return sample_episodes(engine, _model(), env, prompts, SECRETS, ids, mask, samples, reprefill=reprefill)


def test_kv_cache_across_turns_draws_what_reprefilling_draws_and_prefills_only_new_tokens(byte_tokenizer):
    kept = _episodes(byte_tokenizer, GuessingGame(max_turns=4))
    again = _episodes(byte_tokenizer, GuessingGame(max_turns=4), reprefill=True)
    assert torch.equal(kept.response_ids, again.response_ids)
    assert torch.equal(kept.response_mask, again.response_mask)
    assert torch.equal(kept.episodes.response_attention, again.episodes.response_attention)
    chat = ChatFormat(byte_tokenizer)
    reply = len(chat.reply_ids([{"role": "user", "content": "a number?"}], [1]))
    # after turn 0 each continuing row prefills its turn's last sampled token and the reply (every reply of the
    # random model is "a number?" or higher/lower, so count each row's real environment tokens)
    env_tokens = (kept.episodes.response_attention - kept.response_mask).sum().item()
    turns = torch.tensor(kept.episodes.metrics["turns"])
    assert sum(kept.episodes.prefilled[1:]) == env_tokens + (turns - 1).sum().item()
    assert kept.episodes.prefilled[0] == 10 + 2 + 6  # the three prompts' tokens, once each (not once per sample)
    assert reply > 10 and len(kept.episodes.prefilled) == 4
    total = kept.attention_mask.sum().item()
    assert sum(kept.episodes.prefilled) <= total  # never more than the episodes' own tokens
    assert sum(again.episodes.prefilled) > 2 * sum(kept.episodes.prefilled)


def test_masks_have_holes_rewards_sit_on_turn_ends_and_no_gradient_reaches_environment_tokens(byte_tokenizer):
    rollout = _episodes(byte_tokenizer, Chatter(), samples=1)
    info, mask = rollout.episodes, rollout.response_mask
    holes = (info.response_attention == 1) & (mask == 0)
    assert holes.any() and (info.token_rewards[mask == 0] == 0).all()
    assert torch.allclose(info.returns, torch.tensor([0.0 + 0.5 + 1.0 + 1.5] * 3))
    model, P = _model(), rollout.prompt_ids.shape[1]
    ids, attention = rollout.input_ids, rollout.attention_mask
    positions = (attention.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    logits.retain_grad()
    logprobs = selective_log_softmax(logits[:, P - 1 : -1], rollout.response_ids)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    loss, _ = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    grad = logits.grad[:, P - 1 : -1].abs().sum(-1)  # row t predicts response token t
    assert (grad[holes] == 0).all() and (grad[mask.bool()] > 0).all()
    # the rollout's log-probs (padded or packed path) equal a plain forward per turn, the history dense
    scored = response_logps(model, ids, attention, P).logprobs
    for r in range(ids.shape[0]):
        real = ids[r][attention[r].bool()].tolist()
        start = int(rollout.prompt_mask[r].sum())
        turn_starts = [t for t in range(mask.shape[1]) if mask[r, t] and (t == 0 or not mask[r, t - 1])]
        for t0 in turn_starts:
            length = int(mask[r, t0:].tolist().index(0)) if 0 in mask[r, t0:].tolist() else mask.shape[1] - t0
            prefix = torch.tensor([real[: start + t0 + length]])
            plain = torch.log_softmax(model(input_ids=prefix).logits[0, start + t0 - 1 : -1].float(), -1)
            want = plain.gather(1, prefix[0, start + t0 :, None]).squeeze(1)
            torch.testing.assert_close(scored[r, t0 : t0 + length], want, atol=1e-5, rtol=1e-5)


def test_one_turn_episode_gives_the_single_response_path_tokens(byte_tokenizer):
    prompts, ids, mask = _prompts(byte_tokenizer)
    engine = RolloutEngine(byte_tokenizer, GenerationConfig(max_new_tokens=12, temperature=1.0))
    plain = engine.sample(_model(), ids, mask, 4, seed=7)

    def reward(prompts, responses, metadata):
        return [float(len(r)) for r in responses]

    torch.manual_seed(7)
    one = sample_episodes(engine, _model(), OneTurnEpisode(reward), prompts, SECRETS, ids, mask, 4)
    width = one.response_ids.shape[1]
    assert width == plain.response_ids.shape[1]
    assert torch.equal(one.response_ids * one.response_mask, plain.response_ids * plain.response_mask)
    assert torch.equal(one.response_mask, plain.response_mask) and torch.equal(one.ended, plain.ended)
    assert one.texts == plain.texts
    assert one.episodes.returns.tolist() == [float(len(t)) for t in plain.texts]


def test_gae_and_reinforce_pp_run_across_the_holes_of_an_episode():
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1, 0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.2, 0.4, 9.0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # over the model's tokens only: t=4: 1 - 0.4; t=3: 0.4 - 0.2 + 0.6; t=0: 0.2 - 0.5 + 0.8
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0, 0, 0.8, 0.6, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 0, 0, 1.0, 1.0, 0]]))
    half, _ = gae(rewards, values, mask, gamma=0.5, lam=1.0)  # discounting counts model tokens, not the hole
    assert half[0, 0].item() == pytest.approx(0.5 * 0.5 * 1.0 - 0.5)
    two = torch.cat([mask, torch.tensor([[1, 1, 1, 1, 1, 1]])])
    out = reinforce_pp_advantages(torch.cat([rewards, rewards]), two, torch.tensor([0, 1]))
    assert out[0, 0] == out[0, 3] == out[0, 4] and (out[0, [1, 2, 5]] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_algorithms_raise_held_out_success_on_the_guessing_game(tmp_path, advantage):
    from aitraining_pl.modules.critic_free import CriticFreeModule

    torch.manual_seed(0)
    module = episode_module(GuessingGame(max_turns=3), module_class=CriticFreeModule, advantage=advantage)
    before = held_out_success(module)
    fit_on_the_game(module, tmp_path, epochs=2)
    after = held_out_success(module)
    assert after >= before + 0.07, (before, after)


@pytest.mark.slow
def test_ppo_raises_held_out_success_on_the_guessing_game(tmp_path):
    """PPO with its critic: per-turn rewards on each turn's last token, GAE across the holes. One episode per
    prompt, so 64 prompts per batch give the 64 episodes per iteration of the critic-free tests (8 prompts x 8)."""
    import lightning.pytorch as pl

    from aitraining_pl.modules.ppo import PPOModule

    class Curve(pl.Callback):  # held-out success after each epoch, the training draws left as they were
        def on_train_epoch_end(self, trainer, module):
            state = torch.get_rng_state()
            curve.append(held_out_success(module))
            torch.set_rng_state(state)

    torch.manual_seed(0)
    module = PPOModule(
        model_config=dict(TINY_LLAMA),
        tokenizer_name="byte",
        reward=GuessingGame(max_turns=3),
        generation=GenerationConfig(max_new_tokens=2, temperature=1.0),
        learning_rate=0.01,
        mini_batch_size=32,
        num_iterations=2,
        kl_coef=0.0,
        seed=0,
    )
    curve = [held_out_success(module)]
    fit_on_the_game(module, tmp_path, epochs=4, prompts=512, batch_size=64, callbacks=[Curve()])
    print("PPO held-out success by epoch:", [round(x, 3) for x in curve])
    assert curve[-1] >= curve[0] + 0.1 and max(curve[1:]) >= curve[0] + 0.07, curve


def test_ppo_trains_on_episodes_with_per_turn_rewards(tmp_path):
    from aitraining_pl.modules.ppo import PPOModule

    torch.manual_seed(0)
    module = PPOModule(
        model_config=dict(TINY_LLAMA),
        tokenizer_name="byte",
        reward=GuessingGame(max_turns=2),
        generation=GenerationConfig(max_new_tokens=2, temperature=1.0),
        mini_batch_size=8,
        ppo_epochs=1,
        learning_rate=0.01,
    )
    seen = {}
    make_experience = module.make_experience

    def spy(rollout):
        experience, stats = make_experience(rollout)
        seen.update(rollout=rollout, experience=experience)
        return experience, stats

    module.make_experience = spy
    before = [p.detach().clone() for p in module.policy.parameters()]
    fit_on_the_game(module, tmp_path, epochs=1)
    rollout, experience = seen["rollout"], seen["experience"]
    holes = (rollout.attention_mask[:, rollout.prompt_length :] == 1) & (rollout.mask == 0)
    assert holes.any() and (experience.advantages[holes] == 0).all() and (experience.returns[holes] == 0).all()
    assert torch.equal(rollout.token_scores.sum(1), rollout.scores)  # per-turn rewards sum to the return
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))


def test_sampling_callback_logs_whole_episodes_and_their_metrics():
    from aitraining_pl.callbacks.sampling import SamplingCallback
    from aitraining_pl.modules.critic_free import GRPOModule

    module = GRPOModule(
        model_config=dict(TINY_LLAMA),
        tokenizer_name="byte",
        reward=GuessingGame(max_turns=3),
        generation=GenerationConfig(max_new_tokens=2, temperature=1.0),
        kl_coef=0.0,
    )
    rows = SamplingCallback().sample(module, ["Guess 1-7:", "Guess!"], [{"secret": 2}, {"secret": 6}])
    assert len(rows) == 2 and {"episode", "turns", "truncated", "success", "valid", "reward"} <= set(rows[0])

    episode = json.loads(rows[0]["episode"])
    assert (
        episode[0]["role"] == "assistant" and len([m for m in episode if m["role"] == "assistant"]) == rows[0]["turns"]
    )


def test_seed_environments_play_one_turn_episodes_with_their_own_scores(byte_tokenizer):
    from aitraining_pl.environments import MathProblemEnv

    env = MathProblemEnv()
    prompts, ids, mask = _prompts(byte_tokenizer)
    metadata = [{"answer": 4}, {"answer": 7}, {"answer": 1}]
    engine = RolloutEngine(byte_tokenizer, GenerationConfig(max_new_tokens=6, temperature=1.0))
    torch.manual_seed(0)
    out = sample_episodes(engine, _model(), env.as_episode(), prompts, metadata, ids, mask, 2)
    rows = out.group.tolist()
    want = env([prompts[i] for i in rows], out.texts, [metadata[i] for i in rows])
    assert out.episodes.returns.tolist() == pytest.approx(want)
    assert out.episodes.metrics["turns"] == [1.0] * 6
