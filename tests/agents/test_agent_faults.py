"""What an agent can do wrong and what the run then does: ``on_agent_error`` (stop, zero_reward, drop; counted),
agents sharing one client (counted and warned once), an async agent that blocks its loop or swallows its
cancellation (timed out at ``reward_timeout``, the loop's thread abandoned), a chat template that cannot mark
assistant turns (refused when the environment is built), and the quickstart agent on a '²' answer."""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest
import torch
from conftest import TINY_LLAMA

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.errors import RewardError  # noqa: E402
from aitraining_pl.models import build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

TEXTS = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def policy():
    tokenizer = load_tokenizer("byte", padding_side="left")
    model = build_causal_lm(dict(TINY_LLAMA), seed=0).eval()
    return tokenizer, model, RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=2))


def _play(env, policy, texts=TEXTS, timeout=60):
    tokenizer, model, engine = policy
    ids = torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    metadata = [{"i": i} for i in range(len(texts))]
    try:
        return env.play_episodes(engine, model, texts, metadata, ids, torch.ones_like(ids), 1, timeout=timeout)
    finally:
        env.close()


def _fails_on_odd(client, prompt, metadata):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    if metadata["i"] % 2:
        raise RuntimeError("ModelBehaviorError: the reply hit max_tokens with no text")
    return 1.0


@pytest.mark.parametrize("policy_name", ["stop", "zero_reward", "drop"])
def test_on_agent_error_stops_scores_zero_or_drops_and_counts(policy, policy_name):
    env = AgentEnvironment(_fails_on_odd, max_sequences=1, on_agent_error=policy_name)
    if policy_name == "stop":
        with pytest.raises(RewardError, match="episode 1 raised RuntimeError: ModelBehaviorError"):
            _play(env, policy)
        return
    with pytest.warns(UserWarning, match=f"on_agent_error: {policy_name}"):
        out = _play(env, policy)
    assert out.episodes.metrics["agent_errors"] == [0.0, 1.0, 0.0, 1.0]
    assert out.episodes.returns.tolist() == [1.0, 0.0, 1.0, 0.0]
    trained = out.response_mask.sum(1).gt(0).tolist()
    assert trained == ([True] * 4 if policy_name == "zero_reward" else [True, False, True, False])


def test_a_bad_on_agent_error_is_refused():
    with pytest.raises(ValueError, match="on_agent_error must be one of stop, zero_reward, drop, got 'skip'"):
        AgentEnvironment(_fails_on_odd, on_agent_error="skip")


SHARED: dict = {}


async def _shared_client(client, prompt, metadata):
    """The OpenAI Agents SDK's ``set_default_openai_client`` habit: the last episode's client serves everyone."""
    SHARED.setdefault("client", client)
    done = SHARED.setdefault("done", asyncio.Event())
    await asyncio.sleep(0.05)
    messages = [{"role": "user", "content": prompt}]
    await SHARED["client"].chat.completions.create(model="m", messages=messages, max_tokens=2)
    SHARED["calls"] = SHARED.get("calls", 0) + 1
    if SHARED["calls"] == len(TEXTS):
        done.set()
    await done.wait()  # the owner of the shared key returns last (else the others' calls are refused: 403)
    return 1.0


def test_agents_sharing_one_client_are_counted_and_warned_once(policy):
    env = AgentEnvironment(_shared_client, max_sequences=1, batch_window=0.5)
    SHARED.clear()
    with pytest.warns(UserWarning, match="share one client") as seen:
        out = _play(env, policy)
    assert sum(out.episodes.metrics["no_calls"]) == 3
    assert sum(out.episodes.metrics["overlapping_calls"]) >= 1
    assert sum("share one client" in str(w.message) for w in seen) == 1


async def _blocks(client, prompt, metadata):
    time.sleep(8)  # blocking code holds the loop: asyncio.wait_for cannot fire
    return 1.0


async def _swallows(client, prompt, metadata):
    while True:
        try:
            await asyncio.sleep(8)
        except asyncio.CancelledError:
            continue


@pytest.mark.parametrize("agent", [_blocks, _swallows], ids=["blocks", "swallows-cancel"])
def test_an_async_agent_that_blocks_or_ignores_cancellation_times_out(policy, agent):
    env = AgentEnvironment(agent, max_sequences=1)
    began = time.monotonic()
    with pytest.raises(RewardError, match="did not return within the timeout"):
        _play(env, policy, texts=TEXTS[:1], timeout=1.0)
    assert time.monotonic() - began < 6


def test_a_chat_template_without_assistant_markers_is_refused_when_built():
    contents_only = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="chat_template: the chat template does not mark assistant turns"):
        AgentEnvironment(_fails_on_odd, chat_template=contents_only)


def test_the_quickstart_agent_reads_a_superscript_as_no_digit():
    from aitraining_pl.data.calculator_agent import calculator_agent

    class Reply:
        def __init__(self, text):
            message = type("M", (), {"content": text, "tool_calls": None, "model_dump": lambda self, **k: {}})()
            self.choices = [type("C", (), {"message": message})()]

    class Client:
        chat = type("Chat", (), {})()

    answers = iter(["²", "²", "²"])
    Client.chat.completions = type("Done", (), {"create": staticmethod(lambda **k: Reply(next(answers)))})()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calculator_agent(Client(), "2+3=", {"expression": "2+3"}) == 0.0


def test_a_misplaced_override_key_is_named_not_dropped():
    """Probe 9: ``--model.init_args.reward.init_args.agent X`` puts ``agent`` beside ``class_path``."""
    from aitraining_pl.rewards import build_reward_source

    spec = {
        "class_path": "aitraining_pl.agents.AgentEnvironment",
        "init_args": {"agent": "aitraining_pl.data.calculator_agent:calculator_agent"},
        "agent": "my_pkg.agents:better",
    }
    with pytest.raises(ValueError, match="key 'agent' is neither class_path nor init_args, so it would be ignored"):
        build_reward_source(spec)
