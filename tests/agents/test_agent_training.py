"""GRPO trains the quickstart's calculator agent (``aitraining_pl/data/calculator_agent.py``, written with the
``openai`` client) through the endpoint: every iteration's episodes come from ``AgentEnvironment.play_episodes``,
and the held-out success rises (3 epochs of 8 iterations: success 0.04 -> 0.15, mean reward 0.07 -> 0.28 on every
run, since each batch waits for every running episode's call; 2 epochs gave 0.11 / 0.20); a history-rewriting agent
trains with two rows per episode."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import quiet_trainer
from episode_fixtures import episode_module

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.data.calculator_agent import calculator_agent  # noqa: E402
from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.rollout import RolloutEngine  # noqa: E402

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
    module = episode_module(env)
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


def _rewriter(client, prompt, metadata):
    """Three calls; the third drops the first exchange: two sequences per episode."""
    first = [{"role": "user", "content": prompt}]
    a1 = client.chat.completions.create(model="m", messages=first).choices[0].message.content
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "more"}]
    a2 = client.chat.completions.create(model="m", messages=second).choices[0].message.content
    third = [
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": a2},
        {"role": "user", "content": "end"},
    ]
    return float(len(client.chat.completions.create(model="m", messages=third).choices[0].message.content or ""))


def test_grpo_trains_on_a_history_rewriting_agent_with_two_rows_per_episode(tmp_path):
    """``max_sequences: 2``: every episode gives two rows (``episodes.episode`` names it), every rank the same row
    count; the update runs on them and moves the policy."""
    torch.manual_seed(0)  # the draws (some answers shorter than others), whatever ran before in the process
    env = AgentEnvironment(_rewriter, max_sequences=2)
    module = episode_module(env, max_new_tokens=3, num_generations=2, mini_batch_size=4)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"hi {i}"}) + "\n" for i in range(4)))
    before = [p.detach().clone() for p in module.policy.parameters()]
    try:
        quiet_trainer(tmp_path, max_steps=4).fit(module, datamodule=PromptDataModule(data_path=str(path), batch_size=2))
    finally:
        env.close()
    assert module.global_step == 4  # 2 iterations of 2 prompts x 2 episodes x 2 rows, 4 rows per optimizer step
    assert module.last_episodes.episode.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert module.last_episodes.metrics["sequences"] == [2.0] * 8
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
