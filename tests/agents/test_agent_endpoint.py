"""The endpoint's HTTP surface: ``/v1/models``, a plain call answered with the ``openai`` types (choices, usage,
log-probs) and recorded token-in / token-out, ``n`` choices, an unknown or finished episode key refused with a 4xx
(nothing recorded), and malformed requests answered with OpenAI error bodies."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from aitraining_pl.agents import AgentEndpoint  # noqa: E402
from aitraining_pl.environments.chat import ChatFormat  # noqa: E402
from aitraining_pl.models import build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def endpoint():
    tokenizer = load_tokenizer("byte", padding_side="left")
    model = build_causal_lm(dict(TINY_LLAMA), seed=0).eval()
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=5, temperature=1.0))
    with AgentEndpoint(engine, model) as served:
        served.bind(engine, model, version=7)  # the weights version every call records
        yield served


def _client(endpoint, key):
    return openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)


def test_models_and_a_call_recorded_token_in_token_out(endpoint):
    key = endpoint.open_episode()
    client = _client(endpoint, key)
    assert [m.id for m in client.models.list().data] == ["policy"]
    reply = client.chat.completions.create(model="anything", messages=HELLO, logprobs=True, n=2, max_tokens=3)
    assert len(reply.choices) == 2 and reply.usage.completion_tokens <= 6
    records = endpoint.finish_episode(key)
    prompt = ChatFormat(endpoint.engine.tokenizer).prompt_ids(HELLO)
    assert [r.prompt_ids for r in records] == [prompt, prompt] and reply.usage.prompt_tokens == len(prompt)
    for record, choice in zip(records, reply.choices):
        assert 1 <= len(record.completion_ids) <= 3 and record.version == 7
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(record.logprobs, abs=1e-6)
        assert choice.finish_reason == ("stop" if record.ended else "length")
        text = endpoint.engine.tokenizer.decode(record.completion_ids, skip_special_tokens=True)
        assert choice.message.content == text
    client.close()


def test_an_unknown_or_finished_key_is_refused_and_nothing_is_recorded(endpoint):
    with pytest.raises(openai.AuthenticationError) as unknown:
        _client(endpoint, "ep-not-a-key").chat.completions.create(model="m", messages=HELLO)
    assert unknown.value.status_code == 401 and unknown.value.body["code"] == "invalid_api_key"
    key = endpoint.open_episode()
    assert endpoint.finish_episode(key) == []
    with pytest.raises(openai.PermissionDeniedError) as finished:
        _client(endpoint, key).chat.completions.create(model="m", messages=HELLO)
    assert finished.value.status_code == 403 and finished.value.body["code"] == "episode_finished"
    assert endpoint.episodes[key].records == []


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b"{not json", None, "not JSON"),
        ({"model": "m"}, "messages", "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list of text parts"),
        ({"messages": HELLO, "stream": "yes"}, "stream", "true or false"),
        ({"messages": HELLO, "temperature": "hot"}, "temperature", "must be a number"),
        ({"messages": HELLO, "n": 0}, "n", "must be an integer"),
        ({"messages": HELLO, "stop": [1, 2]}, "stop", "stop must be a string"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools", "tools must be a list"),
        ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "does not render"),
    ],
)
def test_malformed_requests_get_openai_error_bodies(endpoint, body, param, words):
    key = endpoint.open_episode()
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{endpoint.base_url}/chat/completions"
    if isinstance(body, bytes):
        answer = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        answer = httpx.post(url, json=body, headers=headers)
    error = answer.json()["error"]
    assert answer.status_code == 400 and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]
    assert endpoint.finish_episode(key) == []  # nothing recorded


def test_the_package_names_the_extra_when_it_is_missing(monkeypatch):
    import builtins

    from aitraining_pl.agents import require_agents_extra

    real = builtins.__import__

    def without_fastapi(name, *args, **kwargs):
        if name == "fastapi":
            raise ImportError("No module named 'fastapi'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_fastapi)
    with pytest.raises(ImportError, match=r"pip install 'aitraining-pl\[agents\]'"):
        require_agents_extra()


def test_stop_strings_and_request_sampling(endpoint):
    """``stop`` ends a completion at the string (kept, as the run's stop strings are); a request's temperature is
    ignored by default (the run's distribution samples) and honoured with ``request_sampling`` (0: greedy)."""
    tokenizer, model = endpoint.engine.tokenizer, endpoint.model
    greedy = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=5, do_sample=False))
    prompt = ChatFormat(tokenizer).prompt_ids(HELLO)
    ids = torch.tensor([prompt])
    expected = greedy.sample(model, ids, torch.ones_like(ids)).response_ids[0].tolist()
    stop = tokenizer.decode(expected[:2])
    key = endpoint.open_episode()
    client = _client(endpoint, key)
    try:
        endpoint.request_sampling = True
        draws = [client.chat.completions.create(model="m", messages=HELLO, temperature=0) for _ in range(2)]
        stopped = client.chat.completions.create(model="m", messages=HELLO, temperature=0, stop=[stop])
    finally:
        endpoint.request_sampling = False
        client.close()
    records = endpoint.finish_episode(key)
    assert [r.completion_ids for r in records[:2]] == [expected[: len(records[0].completion_ids)]] * 2
    n = len(records[2].completion_ids)  # the first prefix whose text holds the stop string (bytes may merge)
    assert n <= 2 and records[2].completion_ids == expected[:n] and stopped.choices[0].finish_reason == "stop"
    assert stop in tokenizer.decode(expected[:n]) and stop not in tokenizer.decode(expected[: n - 1])
    assert draws[0].choices[0].message.content == draws[1].choices[0].message.content
