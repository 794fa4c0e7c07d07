"""Agents through the endpoint train on what was sampled: an ``openai``-client calculator agent gives the tokens,
masks and log-probs of the same conversation played by the in-process ``ToolEnvironment`` (greedy, and with tool
calls the "model" writes); a history-rewriting agent gives two sequences with hand-checked masks; 16 concurrent
episodes (threads and asyncio) are each attributed to their own episode; an agent's faults are one line."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from agent_fixtures import (
    CALCULATOR_TOOL,
    CalculatorTurns,
    answer_length_reward,
    calculator_agent,
    row_sequence,
    script_sampler,
)
from architectures import sharpen
from chat_templates import template_tokenizer
from conftest import TINY_LLAMA

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.environments.chat import ChatFormat  # noqa: E402
from aitraining_pl.environments.episode_rollout import sample_episodes  # noqa: E402
from aitraining_pl.environments.multiturn import calculator  # noqa: E402
from aitraining_pl.errors import RewardError  # noqa: E402
from aitraining_pl.models import build_causal_lm  # noqa: E402
from aitraining_pl.models.rollout_scoring import response_logps  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

PROMPTS = ["Add 2 and 3.", "Go", "What is 6 * 7?"]


@pytest.fixture(scope="module")
def qwen():
    tokenizer, end = template_tokenizer("qwen2.5")
    tokenizer.padding_side = "left"
    config = {
        **TINY_LLAMA,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 2048,
    }  # the Qwen template: ~840 tokens
    model = sharpen(build_causal_lm(config, seed=0), 4.0).eval()
    return tokenizer, end, model


@pytest.fixture(scope="module")
def endpoint_env():
    """One environment (one endpoint) per test module; tests swap the agent."""
    env = AgentEnvironment(calculator_agent, max_sequences=1)
    yield env
    env.close()


def _rendered_prompts(tokenizer, tools=(CALCULATOR_TOOL,), texts=PROMPTS):
    """The data module's prompts as the chat template renders the agent's first call (so the rows' prompt columns
    are comparable with the in-process path's)."""
    chat = ChatFormat(tokenizer, list(tools))
    rows = [chat.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return ids, mask


def _engine(tokenizer, **generation):
    """The rollout engine; a turn ends at the template's ``<|im_end|>`` (or EOS)."""
    ends = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    return RolloutEngine(tokenizer, GenerationConfig(**generation), end_token_ids=ends)


def _both(env, tokenizer, model, agent, environment, samples=1, **play):
    ids, mask = _rendered_prompts(tokenizer)
    engine = _engine(tokenizer, max_new_tokens=6, do_sample=False)
    metadata = [{} for _ in PROMPTS]
    local = sample_episodes(engine, model, environment, PROMPTS, metadata, ids, mask, samples, **play)
    env.agent = agent
    remote = env.play_episodes(engine, model, PROMPTS, metadata, ids, mask, samples, timeout=120)
    return local, remote


def _assert_same_tokens(local, remote):
    width = local.response_ids.shape[1]
    assert torch.equal(remote.prompt_ids, local.prompt_ids) and torch.equal(remote.prompt_mask, local.prompt_mask)
    assert torch.equal(remote.response_ids[:, :width], local.response_ids)
    assert torch.equal(remote.response_mask[:, :width], local.response_mask)
    assert torch.equal(remote.episodes.response_attention[:, :width], local.episodes.response_attention)
    assert not remote.episodes.response_attention[:, width:].any()
    assert torch.equal(remote.episodes.returns, local.episodes.returns)
    assert torch.equal(remote.episodes.token_rewards[:, :width], local.episodes.token_rewards)
    assert torch.equal(remote.ended, local.ended) and remote.texts == local.texts
    assert torch.equal(remote.episodes.episode, torch.arange(len(PROMPTS)))


def test_greedy_calculator_agent_equals_the_in_process_tool_environment(qwen, endpoint_env):
    """Three calls per episode (two answered by the calculator): one sequence each, the tokens, masks and rewards
    of ``ToolEnvironment``'s episodes, and the recorded log-probs are the trainer's on the sampled tokens."""
    tokenizer, _, model = qwen
    environment = CalculatorTurns([calculator], reward=answer_length_reward, max_turns=4)
    local, remote = _both(endpoint_env, tokenizer, model, calculator_agent, environment)
    assert local.episodes.metrics["turns"] == [3.0] * 3 and remote.episodes.metrics["calls"] == [3.0] * 3
    assert "<tool_response>" in tokenizer.decode(remote.response_ids[0])
    _assert_same_tokens(local, remote)
    trainer = response_logps(model, remote.input_ids, remote.attention_mask, remote.prompt_ids.shape[1]).logprobs
    sampled = remote.response_mask.bool()
    assert (remote.sampling_logprobs[~sampled] == 0).all()
    assert (trainer - remote.sampling_logprobs)[sampled].abs().max() < 1e-4


def _tool_caller(end: str):
    """The scripted model: calls the calculator on 2+3 until it has a tool response, then answers with it."""

    def write(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>' + end
        return "It is " + prompt.rsplit("<tool_response>\n", 1)[1].split("\n")[0] + end

    return write


def test_tool_calls_the_model_writes_come_back_as_openai_tool_calls(qwen, endpoint_env, monkeypatch):
    """The "model" writes a Hermes tool call: the endpoint returns it as ``tool_calls`` (parsed by the episode
    path's parser), the agent runs it and sends the result; the episode equals ``ToolEnvironment``'s."""
    tokenizer, _, model = qwen
    script_sampler(monkeypatch, tokenizer, _tool_caller("<|im_end|>"))
    environment = CalculatorTurns([calculator], reward=answer_length_reward, max_turns=4)
    environment.forced = 0
    agent = functools.partial(calculator_agent, forced=0)
    local, remote = _both(endpoint_env, tokenizer, model, agent, environment, reprefill=True)
    assert remote.texts[0].endswith("It is 5") and remote.episodes.metrics["tool_calls"] == [1.0] * 3
    assert local.episodes.metrics["tool_calls"] == [1.0] * 3
    _assert_same_tokens(local, remote)


def _rewriter(client, prompt, metadata):
    """Three calls; the third drops the first exchange (the history is rewritten)."""
    first = [{"role": "user", "content": prompt}]
    a1 = client.chat.completions.create(model="m", messages=first).choices[0].message.content
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "more"}]
    a2 = client.chat.completions.create(model="m", messages=second).choices[0].message.content
    third = [
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": a2},
        {"role": "user", "content": "end"},
    ]
    client.chat.completions.create(model="m", messages=third)
    return 1.0


def test_a_history_rewriting_agent_gives_two_sequences_with_hand_checked_masks(qwen, endpoint_env, monkeypatch):
    tokenizer, _, model = qwen
    script_sampler(monkeypatch, tokenizer, lambda prompt: f"A{prompt.count('<|im_start|>user')}<|im_end|>")
    endpoint_env.agent, endpoint_env.max_sequences = _rewriter, 3
    ids, mask = _rendered_prompts(tokenizer, tools=(), texts=PROMPTS[:1])
    engine = _engine(tokenizer, max_new_tokens=8, do_sample=False)
    try:
        out = endpoint_env.play_episodes(engine, model, PROMPTS[:1], [{}], ids, mask, 1, timeout=60)
    finally:
        endpoint_env.max_sequences = 1
    assert out.response_ids.shape[0] == 3 and out.episodes.metrics["sequences"] == [2.0] * 3
    assert out.group.tolist() == [0, 0, 0] and out.episodes.episode.tolist() == [0, 0, 0]
    chat, encode = ChatFormat(tokenizer), lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    im_end = encode("<|im_end|>")
    a1, a2, a3 = (encode(f"A{i}") + im_end for i in (1, 2, 2))
    p1 = chat.prompt_ids([{"role": "user", "content": PROMPTS[0]}])
    reply = encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    p3 = chat.prompt_ids(
        [
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "A2"},
            {"role": "user", "content": "end"},
        ]
    )
    # row 0: the first two calls, one sequence: prompt, A1 (sampled), the user's "more" (masked), A2 (sampled)
    tokens, sampled = row_sequence(out, 0)
    assert tokens == p1 + a1 + reply + a2
    assert sampled == [0] * len(p1) + [1] * len(a1) + [0] * len(reply) + [1] * len(a2)
    # row 1: the rewritten history, rendered whole (A2 there is context, re-rendered: never marked), then A2
    tokens, sampled = row_sequence(out, 1)
    assert tokens == p3 + a3 and sampled == [0] * len(p3) + [1] * len(a3)
    assert out.prompt_mask[1].sum() == 0  # it does not start with the data module's prompt: shown once, in full
    # row 2: unused, all masked; every row carries the episode's reward, on each sequence's last sampled token
    assert out.response_mask[2].sum() == 0 and out.episodes.response_attention[2].sum() == 0
    assert out.episodes.returns.tolist() == [1.0] * 3
    assert out.episodes.token_rewards.sum(1).tolist() == [1.0, 1.0, 0.0]


def _attributed_sync(client, prompt, metadata):
    text = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
    again = [{"role": "user", "content": prompt}, text.choices[0].message.model_dump(exclude_none=True)]
    client.chat.completions.create(model="m", messages=[*again, {"role": "user", "content": prompt}])
    return float(metadata["i"])


async def _attributed_async(client, prompt, metadata):
    text = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
    again = [{"role": "user", "content": prompt}, text.choices[0].message.model_dump(exclude_none=True)]
    await client.chat.completions.create(model="m", messages=[*again, {"role": "user", "content": prompt}])
    return float(metadata["i"])


@pytest.mark.parametrize("agent", [_attributed_sync, _attributed_async], ids=["threads", "asyncio"])
def test_sixteen_concurrent_episodes_are_each_attributed_to_their_own_episode(qwen, endpoint_env, agent):
    tokenizer, _, model = qwen
    texts = [f"episode {i:02d} " + "x" * i for i in range(16)]
    ids, mask = _rendered_prompts(tokenizer, tools=(), texts=texts)
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=4, temperature=1.0))
    endpoint_env.agent = agent
    out = endpoint_env.play_episodes(engine, model, texts, [{"i": i} for i in range(16)], ids, mask, 1, timeout=120)
    assert out.episodes.metrics["calls"] == [2.0] * 16 and out.episodes.metrics["sequences"] == [1.0] * 16
    for i in range(16):
        tokens, _ = row_sequence(out, i)
        assert tokenizer.decode(tokens).count(texts[i]) == 2  # both calls of episode i, and only them
        assert out.episodes.returns[i] == i and out.episodes.token_rewards[i].sum() == i


def _raises(client, prompt, metadata):
    raise KeyError("boom")


def _nan(client, prompt, metadata):
    return float("nan")


@pytest.mark.parametrize(
    "agent, line",
    [(_raises, "agent '_raises': episode 0 raised KeyError: 'boom'"), (_nan, "non-finite reward (nan)")],
)
def test_an_agents_fault_is_one_reward_error_naming_it(qwen, endpoint_env, agent, line):
    tokenizer, _, model = qwen
    ids, mask = _rendered_prompts(tokenizer, tools=(), texts=PROMPTS[:1])
    endpoint_env.agent = agent
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=2))
    with pytest.raises(RewardError, match=line.replace("(", r"\(").replace(")", r"\)")):
        endpoint_env.play_episodes(engine, model, PROMPTS[:1], [{}], ids, mask, 1, timeout=60)


def test_an_async_agent_past_the_timeout_is_one_reward_error(qwen, endpoint_env):
    tokenizer, _, model = qwen

    async def hangs(client, prompt, metadata):
        await asyncio.Event().wait()

    ids, mask = _rendered_prompts(tokenizer, tools=(), texts=PROMPTS[:1])
    endpoint_env.agent = hangs
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=2))
    with pytest.raises(RewardError, match="did not return within the timeout"):
        endpoint_env.play_episodes(engine, model, PROMPTS[:1], [{}], ids, mask, 1, timeout=0.5)
