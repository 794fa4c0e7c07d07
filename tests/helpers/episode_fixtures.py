"""Shared by the episode tests (HF and vLLM): a critic-free module for an episode environment, the guessing game's
held-out success and a short fit on it, the secrets of the three test prompts, left-padded prompt tensors, and the
check that two backends played the same episodes."""

from __future__ import annotations

import torch
from conftest import TINY_LLAMA, quiet_trainer

from aitraining_pl.environments.episode_rollout import sample_episodes
from aitraining_pl.rollout import GenerationConfig, RolloutEngine

SECRETS = [{"secret": 3}, {"secret": 5}, {"secret": 6}]


def episode_module(reward, max_new_tokens: int = 2, module_class=None, **overrides):
    """A critic-free module (``module_class``, default ``GRPOModule``) on the half-width tiny Llama for an episode
    ``reward`` (an environment): ``max_new_tokens`` per turn at temperature 1, no KL, seed 0; ``overrides`` replace or
    add settings (``num_generations`` 8, ``mini_batch_size`` 32, ``learning_rate`` 0.01)."""
    from aitraining_pl.modules.critic_free import GRPOModule

    settings = dict(
        model_config=dict(TINY_LLAMA),
        tokenizer_name="byte",
        reward=reward,
        generation=GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0),
        num_generations=8,
        learning_rate=0.01,
        mini_batch_size=32,
        kl_coef=0.0,
        seed=0,
    )
    return (module_class or GRPOModule)(**{**settings, **overrides})


def held_out_success(module, rows: int = 70, seed: int = 0) -> float:
    """Held-out success rate: episodes on every secret (10 each), sampled at the training temperature."""
    texts, metadata = ["Guess 1-7:"] * rows, [{"secret": 1 + i % 7} for i in range(rows)]
    ids = module.tokenizer(texts[0], add_special_tokens=False, return_tensors="pt")["input_ids"].repeat(rows, 1)
    engine = RolloutEngine(module.tokenizer, module.generation)
    torch.manual_seed(seed)
    out = sample_episodes(engine, module.policy, module.reward_source, texts, metadata, ids, torch.ones_like(ids))
    return float(torch.tensor(out.episodes.metrics["success"]).mean())


def fit_on_the_game(module, tmp_path, epochs: int, prompts: int = 64, batch_size: int = 8, callbacks=()):
    from aitraining_pl.datamodules.prompt import PromptDataModule

    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "Guess 1-7:", "secret": {1 + (i * 3) % 7}}}\n' for i in range(prompts)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, above all on a shared machine
    try:
        quiet_trainer(tmp_path, max_epochs=epochs, callbacks=list(callbacks)).fit(
            module, datamodule=PromptDataModule(data_path=str(path), batch_size=batch_size)
        )
    finally:
        torch.set_num_threads(threads)


def prompt_tensors(tokenizer, texts):
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return ids, mask


def assert_same_episodes(hf, got):
    assert torch.equal(got.prompt_ids, hf.prompt_ids) and torch.equal(got.prompt_mask, hf.prompt_mask)
    assert torch.equal(got.response_ids, hf.response_ids)
    assert torch.equal(got.response_mask, hf.response_mask)
    assert torch.equal(got.episodes.response_attention, hf.episodes.response_attention)
    assert torch.equal(got.episodes.token_rewards, hf.episodes.token_rewards)
    assert torch.equal(got.ended, hf.ended) and got.texts == hf.texts
    assert got.episodes.metrics == hf.episodes.metrics
    assert without_call_ids(got.episodes.transcripts) == without_call_ids(hf.episodes.transcripts)
    assert got.episodes.sampled == hf.episodes.sampled


def without_call_ids(transcripts):  # tool-call ids are drawn at random per call
    return [[{k: v for k, v in m.items() if k != "tool_call_id"} for m in t] for t in transcripts]
