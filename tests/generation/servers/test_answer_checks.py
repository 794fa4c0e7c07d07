"""The fleet's trust in its servers (issue 52, items 7 and 8), against a scripted server (FastAPI from a thread) that
answers ``/v1/completions`` with what a test sets: log-probs above 0, more tokens than ``max_new_tokens``, ids
outside the vocabulary, more log-probs than tokens, weights older than asked for and an HTML page are each one
``BadAnswer`` line naming the server, and in a fleet the request goes to the other server; a server that hangs at
``/v1/models`` before the first call is given up at the request's deadline, not the client's timeout."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import torch
from standin import StandInReplica

from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.answers import BadAnswer
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.replica import ReplicaDown
from aitraining_pl.generation.servers.routing import ReplicaRequest
from aitraining_pl.generation.version import WeightsVersion

GOOD = {"tokens": ["token_id:3", "token_id:4"], "token_logprobs": [-0.5, -1.0]}


@pytest.fixture(scope="module")
def scripted():
    """The scripted server's URL and its script: ``answer`` (the completion choice's ``logprobs``, or ``html``),
    ``versions`` (token_versions, or None), ``hang`` (an event ``/v1/models`` waits on while set in ``script``)."""
    import socket

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, Response

    app, script = FastAPI(), {"answer": GOOD, "versions": None, "hang": None}

    @app.get("/v1/models")
    def models() -> dict:
        if script["hang"] is not None:
            script["hang"].wait(30)
        return {"data": [{"id": "m", "owned_by": "vllm"}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        if script["answer"] == "html":
            return HTMLResponse("<html><body>502 Bad Gateway</body></html>")
        choice = {"index": 0, "logprobs": script["answer"], "token_versions": script["versions"]}
        answer = {"choices": [dict(choice, index=i) for i in range(body["n"])]}
        return Response(json.dumps(answer), media_type="application/json")  # NaN written as Python's json does

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", script
    server.should_exit = True
    thread.join(10)


def ask(version=None, max_new_tokens=8) -> ReplicaRequest:
    ids = torch.tensor([[5, 6, 7]])
    request = SampleRequest(ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=max_new_tokens), [1],
                            StopRule(None), 0, 1, 3)  # fmt: skip
    return ReplicaRequest.of(request, version, vocab=384)


BAD = {
    "log-prob above 0": ({"tokens": ["token_id:3"], "token_logprobs": [5.0]}, None, "log-prob 5.0"),
    "NaN log-prob": ({"tokens": ["token_id:3"], "token_logprobs": [float("nan")]}, None, "log-prob nan"),
    "too many tokens": ({"tokens": ["token_id:3"] * 300, "token_logprobs": [-1.0] * 300}, None, "300 tokens for"),
    "id outside the vocabulary": ({"tokens": ["token_id:1000000"], "token_logprobs": [-1.0]}, None, "1000000"),
    "more log-probs than tokens": ({"tokens": ["token_id:3"], "token_logprobs": [-1.0, -2.0]}, None, "2 log-probs"),
    "older weights": (GOOD, [1, 1], "step 1, not the step 2"),
    "unreadable token": ({"tokens": ["token_id:x"], "token_logprobs": [-1.0]}, None, "cannot be read"),
    "an HTML page": ("html", None, "not a completion"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_an_answer_that_cannot_be_the_request_s_is_refused_naming_the_server(scripted, case):
    url, script = scripted
    script["answer"], script["versions"], expected = BAD[case]
    replica = HTTPReplica(url, None, timeout=30)
    replica.held = WeightsVersion("run", 2)  # the version asked for is served (``wait_for`` passes)
    try:
        with pytest.raises(BadAnswer, match=expected) as caught:
            replica.sample(ask(WeightsVersion("run", 2)), time.monotonic() + 30)
        assert str(caught.value).startswith(url) and "\n" not in str(caught.value)
        script["answer"], script["versions"] = GOOD, None
        out = replica.sample(ask(), time.monotonic() + 30)  # a good answer passes, as it came
        assert out.response_ids.tolist() == [[3, 4]] and out.sampling_logprobs.tolist() == [[-0.5, -1.0]]
    finally:
        script["answer"], script["versions"] = GOOD, None
        replica.close(release=False)


def test_in_a_fleet_a_bad_answer_goes_to_another_server(scripted):
    url, script = scripted
    script["answer"] = {"tokens": ["token_id:3"], "token_logprobs": [5.0]}
    liar, other = HTTPReplica(url, None, timeout=30), StandInReplica("standin://other")
    fleet = Fleet([liar, other], weights=lambda policy: iter(()), run="run")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    request = SampleRequest(ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=3), [0], StopRule(), 0, 1, 7)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fleet.sample(request)
        assert out.response_ids.shape == (2, 3) and sorted(other.prompts) == [[5, 6, 7], [8, 9, 10]]
        lines = [str(w.message) for w in caught if "is down" in str(w.message)]
        assert len(lines) == 1 and url in lines[0] and "log-prob 5.0" in lines[0]
    finally:
        script["answer"] = GOOD
        fleet.close()


def test_a_server_hanging_before_the_first_call_keeps_to_the_deadline(scripted):
    """Item 8: the first call asks ``/v1/models``; it must keep to the request's deadline (0.5 s here), not wait for
    the client's own timeout (20 s)."""
    url, script = scripted
    script["hang"] = threading.Event()
    replica = HTTPReplica(url, None, timeout=20)
    try:
        with pytest.raises(ReplicaDown, match="listing the served model") as caught:
            replica.sample(ask(), time.monotonic() + 0.5)
        seconds = float(str(caught.value).split("within ")[1].split(" s")[0])
        assert seconds <= 0.5, str(caught.value)
    finally:
        script["hang"].set()
        script["hang"] = None
        replica.close(release=False)
