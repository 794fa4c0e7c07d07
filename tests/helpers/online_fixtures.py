"""Shared by the online RL tests (``modules/test_online.py``, ``modules/test_online_options.py``,
``callbacks/test_completion_log.py``, ``callbacks/test_reference_sync.py``): a toy reward source, the quickstart
prompts and a critic-free module whose rollouts are fixed tokens."""

from __future__ import annotations

from pathlib import Path

from conftest import SAMPLER, TINY_LLAMA

import aitraining_pl.rollout as rollout_module
from aitraining_pl.modules.critic_free import CriticFreeModule
from aitraining_pl.rollout import GenerationConfig

TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source

QUICKSTART_PROMPTS = str(Path(__file__).resolve().parents[2] / "aitraining_pl" / "data" / "quickstart_prompts.jsonl")
EOS = 1


def fixed_rollout_module(monkeypatch, scores, fixed, **kwargs):
    """A ``CriticFreeModule`` on the tiny Llama whose rollouts are the rows of ``fixed`` and whose reward returns
    ``scores``."""
    module = CriticFreeModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward=lambda p, r, m: list(scores),
        generation=GenerationConfig(max_new_tokens=fixed.shape[1], temperature=1.0, top_p=1.0),
        **kwargs,
    )
    monkeypatch.setattr(SAMPLER, lambda *a, **k: rollout_module.SampledTokens(fixed.clone()))
    return module
