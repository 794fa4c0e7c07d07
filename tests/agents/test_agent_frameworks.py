"""Agents written with the frameworks people use, each as its own docs write it (LangChain, LangGraph, smolagents,
the OpenAI Agents SDK, LiteLLM), played through the endpoint with each framework's streaming call and a tool call,
and turned into the training rows the online modules train on. The "model" is scripted (``script_sampler``): it
writes a Hermes ``<tool_call>`` for the calculator first and then its answer, as a tool-calling model would, so the
frameworks' tool loops run; what is recorded is what it wrote. Needs the ``frameworks`` extra (skipped without)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from agent_fixtures import script_sampler
from chat_templates import template_tokenizer
from conftest import TINY_LLAMA

pytest.importorskip("fastapi")
pytest.importorskip("openai")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its price list from the network

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.models import build_causal_lm  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

CALL = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
FINAL = '{"name": "final_answer", "arguments": {"answer": "5"}}'


def _write(prompt: str) -> str:
    """The scripted model: the calculator call first; the answer once a tool result is in (smolagents: as its
    ``final_answer`` tool). A prefilled call opening (``tool_choice: required``) is continued, not repeated."""
    turn = prompt.rsplit("<|im_start|>assistant\n", 1)[-1]
    answered = re.search(r"(<tool_response>|Observation:?)\s*5", prompt) is not None  # the calculator's result
    body = (FINAL if "final_answer" in prompt else None) if answered else CALL
    if body is None:
        return "The answer is 5.<|im_end|>"
    head = "" if turn.startswith("<tool_call>") else "<tool_call>\n"
    return f"{head}{body}\n</tool_call><|im_end|>"


@pytest.fixture(scope="module")
def qwen():
    tokenizer, end = template_tokenizer("qwen2.5")
    tokenizer.padding_side = "left"
    # RoPE: a framework's own system prompt (smolagents') takes thousands of byte tokens
    model = build_causal_lm({**TINY_LLAMA, "vocab_size": len(tokenizer), "max_position_embeddings": 1 << 15}, seed=0)
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=64), end_token_ids=[end, tokenizer.eos_token_id])
    return tokenizer, model.eval(), engine


def _play(qwen, monkeypatch, agent, max_sequences=2):
    tokenizer, model, engine = qwen
    script_sampler(monkeypatch, tokenizer, _write)
    env = AgentEnvironment(agent, max_sequences=max_sequences)
    texts = ["What is 2+3?", "Add 2 and 3."]
    ids = torch.tensor([tokenizer(t[:12].ljust(12), add_special_tokens=False)["input_ids"] for t in texts])
    try:
        return env.play_episodes(engine, model, texts, [{}, {}], ids, torch.ones_like(ids), 1, timeout=120)
    finally:
        env.close()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. 2+3
    """
    return str(sum(int(x) for x in re.findall(r"\d+", expression)))


# ---------------------------------------------------------------- the agents, as each framework's docs write them
def langchain_agent(client, prompt, metadata):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    tools = {"calculator": tool(calculator)}
    llm = llm.bind_tools(list(tools.values()))
    messages = [HumanMessage(prompt)]
    reply = None
    for chunk in llm.stream(messages):  # .stream(): the chunks add up to the message
        reply = chunk if reply is None else reply + chunk
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(tools[call["name"]].invoke(call))
    answer = llm.invoke(messages)
    return float("5" in answer.content)


def langgraph_agent(client, prompt, metadata):
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    graph = create_react_agent(llm, tools=[calculator])
    text = ""
    for message, _ in graph.stream({"messages": [("user", prompt)]}, stream_mode="messages"):
        if message.type == "AIMessageChunk":
            text += message.content
    return float("5" in text)


def smolagents_agent(client, prompt, metadata):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id="policy", api_base=str(client.base_url), api_key=client.api_key)
    agent = ToolCallingAgent(tools=[tool(calculator)], model=model, max_steps=3, stream_outputs=True, verbosity_level=0)
    return float(str(agent.run(prompt)) == "5")


async def openai_agents_agent(client, prompt, metadata):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)  # this episode's client, not a default
    agent = Agent(name="calculator", instructions="Use the calculator.", model=model, tools=[function_tool(calculator)])
    result = Runner.run_streamed(agent, prompt, max_turns=3)
    async for _ in result.stream_events():
        pass
    return float("5" in str(result.final_output))


def litellm_agent(client, prompt, metadata):
    import json

    import litellm

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]  # fmt: skip
    ask = dict(model="openai/policy", api_base=str(client.base_url), api_key=client.api_key, tools=tools)
    messages = [{"role": "user", "content": prompt}]
    chunks = list(litellm.completion(messages=messages, stream=True, stream_options={"include_usage": True}, **ask))
    reply = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        result = calculator(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = litellm.completion(messages=messages, **ask).choices[0].message.content
    return float("5" in (answer or ""))


FRAMEWORKS = {
    "langchain": ("langchain_openai", langchain_agent, 1),
    "langgraph": ("langgraph.prebuilt", langgraph_agent, 1),
    "smolagents": ("smolagents", smolagents_agent, 2),  # writes past calls back as text: a sequence per call
    "openai-agents": ("agents.run", openai_agents_agent, 1),  # "agents" alone would find tests/agents
    "litellm": ("litellm", litellm_agent, 1),
}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_a_framework_agent_trains_through_the_endpoint_with_streaming_and_a_tool_call(qwen, monkeypatch, name):
    module, agent, sequences = FRAMEWORKS[name]
    pytest.importorskip(module)
    out = _play(qwen, monkeypatch, agent)
    metrics = {k: v[::2] for k, v in out.episodes.metrics.items()}  # two rows per episode
    assert out.episodes.returns.tolist() == [1.0] * 4  # the tool loop ran and the answer came back
    assert metrics["tool_calls"][0] >= 1 and metrics["calls"][0] == 2
    assert metrics["sequences"][0] == sequences and metrics["no_calls"][0] == 0
    tokenizer = qwen[0]
    sampled = tokenizer.decode(out.response_ids[0][out.response_mask[0].bool()], skip_special_tokens=False)
    assert "calculator" in sampled or sequences > 1  # the model's call is trained on as it was written
