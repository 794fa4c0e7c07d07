"""GRPO trains the quickstart's calculator agent (``aitraining_pl/data/calculator_agent.py``, written with the
``openai`` client) through the endpoint: every iteration's episodes come from ``AgentEnvironment.play_episodes``,
and the held-out success rises (3 epochs of 8 iterations: success 0.04 -> 0.15, mean reward 0.07 -> 0.28 on every
run, since each batch waits for every running episode's call; 2 epochs gave 0.11 / 0.20)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.data.calculator_agent import calculator_agent  # noqa: E402
from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.modules.critic_free import GRPOModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

HELD_OUT = [(a, b) for a in range(5) for b in range(10 - a)]  # every sum of the prompts' kind


def held_out(module, env: AgentEnvironment) -> tuple[float, float]:
    """Success rate (the answers found the right digit) and mean reward of held-out episodes (every sum 3 times)."""
    texts = [f"{a}+{b}=" for a, b in HELD_OUT] * 3
    metadata = [{"expression": t[:-1]} for t in texts]
    rows = [module.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = torch.tensor(rows)  # all of one length
    engine = RolloutEngine(module.tokenizer, module.generation)
    torch.manual_seed(0)
    out = env.play_episodes(engine, module.policy, texts, metadata, ids, torch.ones_like(ids), 1, timeout=120)
    return float((out.episodes.returns > 1.0).float().mean()), float(out.episodes.returns.mean())


@pytest.mark.slow
def test_grpo_through_the_endpoint_raises_held_out_success(tmp_path):
    env = AgentEnvironment(
        calculator_agent,
        max_sequences=1,
        chat_template="aitraining_pl.data.calculator_agent:COMPACT_TOOL_TEMPLATE",
        batch_window=30.0,  # every batch waits for each running episode's call: the same draws on every run
    )
    torch.manual_seed(0)
    module = GRPOModule(
        model_config=dict(TINY_LLAMA),
        tokenizer_name="byte",
        reward=env,
        generation=GenerationConfig(max_new_tokens=2, temperature=1.0),
        num_generations=8,
        learning_rate=0.01,
        mini_batch_size=32,
        kl_coef=0.0,
        seed=0,
    )
    path = tmp_path / "train.jsonl"
    prompts = [HELD_OUT[(i * 7) % len(HELD_OUT)] for i in range(64)]
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "expression": f"{a}+{b}"}) + "\n" for a, b in prompts))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = held_out(module, env)
        quiet_trainer(tmp_path, max_epochs=3).fit(
            module, datamodule=PromptDataModule(data_path=str(path), batch_size=8)
        )
        after = held_out(module, env)
    finally:
        torch.set_num_threads(threads)
        env.close()
    print("held-out (success, reward) through the endpoint:", before, "->", after)
    assert after[0] >= before[0] + 0.08 and after[1] >= before[1] + 0.15, (before, after)
