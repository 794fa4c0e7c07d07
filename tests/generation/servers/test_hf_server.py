"""The HF server's engine (``HFServerEngine``, ``hf_routes`` over HTTP), in the main venv (no vLLM): through a fleet of
one (``Fleet`` over an ``HTTPReplica``) a pushed policy samples as ``HFBackend`` does with the policy itself; a push
that lands mid-generation (``in_flight``) splits a response between two weight versions with each token's log-prob
under its own; a request for an older version is served by a newer one only when it allows it; unseeded requests
draw from the engine's own seeded stream; the teacher mode serves a checkpoint's own weights."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from architectures import model_config
from http_fixtures import http_hf_server

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampleRequest
from aitraining_pl.generation.servers.auth import TOKEN_ENV
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.hf_server import HFServerEngine, load_teacher, meta_model
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.weights import policy_weights
from aitraining_pl.rollout import GenerationConfig, HFBackend, StopRule

SAMPLING = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.7)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of the tiny vocabulary (96 ids; 0 pads, 2 ends)."""
    ids = torch.tensor([[5, 17, 33, 8, 41, 12], [0, 0, 9, 60, 27, 3]])
    return ids, (ids != 0).long()


def decoder_hold(at: int, paused: threading.Event, resume: threading.Event, engines: list | None = None):
    """An ``on_engine`` hook of ``http_hf_server`` that holds the server's decoder before column ``at`` (ahead of the
    server's own ``/pause`` hook): sets ``paused`` there and waits for ``resume``; collects the engines in
    ``engines``."""

    def hold(engine) -> None:
        if engines is not None:
            engines.append(engine)
        served = engine.before_forward

        def before(column: int) -> None:
            if column == at and not paused.is_set():
                paused.set()
                assert resume.wait(60), "the test never resumed the decoder"
            served(column)

        engine.before_forward = before

    return hold


def engine_for(name: str) -> HFServerEngine:
    return HFServerEngine(meta_model(json.dumps(model_config(name)), None), seed=0)


def fleet_of_one(port: int) -> Fleet:
    """The backend of ``generation.server: connect`` to the server on ``port``: a fleet of one."""
    import os

    replica = HTTPReplica(f"http://127.0.0.1:{port}", os.environ[TOKEN_ENV], timeout=60)
    return Fleet([replica], policy_weights, run="run")


def trainer_logprobs(model, prompt_ids, prompt_mask, sampled, temperature: float) -> torch.Tensor:
    """(N, R) the trainer's log-probs of the sampled tokens (teacher forcing), 0 after each end."""
    group = torch.arange(prompt_ids.shape[0]).repeat_interleave(sampled.response_ids.shape[0] // prompt_ids.shape[0])
    inside = (sampled.token_versions >= 0).long()
    ids = torch.cat([prompt_ids[group], sampled.response_ids], 1)
    mask = torch.cat([prompt_mask[group], inside], 1)
    with torch.no_grad():
        return response_logps(model, ids, mask, prompt_ids.shape[1], temperature).logprobs * inside


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])  # gpt2: tied embeddings, learned positions
def test_a_pushed_policy_samples_as_the_policy_itself(name):
    """After a push, prompt ``i`` of a request seeded ``s`` is drawn token for token as ``HFBackend`` draws it alone
    from the policy at seed ``s + i * n`` (vLLM's rule, which the HTTP client keeps; the server's decoder); its
    ``sampling_logprobs`` are the trainer's log-probs of those tokens (fp32) and every token carries the pushed
    step."""
    policy = build_causal_lm(model_config(name), seed=3).eval()
    ids, mask = prompts()
    generation = SAMPLING
    with http_hf_server(model_config(name)) as port:
        fleet = fleet_of_one(port)
        try:
            assert fleet.sync(policy, 7) and not fleet.sync(policy, 7)  # the held version is not pushed again
            served_rows = fleet.sample(SampleRequest(ids, mask, generation, [2], StopRule(), 0, 3, seed=11))
        finally:
            fleet.close()
    for i in range(ids.shape[0]):  # each prompt alone, unpadded, at its own seed
        alone = ids[i : i + 1, mask[i].bool()]
        own = HFBackend(policy).sample(SampleRequest(alone, torch.ones_like(alone), generation, [2], StopRule(), 0, 3,
                                                     seed=11 + 3 * i)).response_ids  # fmt: skip
        served = served_rows.response_ids[3 * i : 3 * i + 3]
        width = max(own.shape[1], served.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731 - both right padded with 0
        assert torch.equal(pad(served), pad(own)), i
    inside = served_rows.token_versions >= 0
    assert set(served_rows.token_versions[inside].tolist()) == {7} and bool(inside[:, 0].all())
    expected = trainer_logprobs(policy, ids, mask, served_rows, SAMPLING.temperature)
    torch.testing.assert_close(served_rows.sampling_logprobs, expected, atol=1e-5, rtol=0)


def test_unseeded_requests_draw_from_the_engines_own_seeded_stream():
    """Without a seed, two engines of the same ``--seed`` draw the same samples; one engine's next request, others."""
    from aitraining_pl.generation.vllm import SampleRequest

    policy = build_causal_lm(model_config("llama"), seed=0)
    engines = [engine_for("llama") for _ in range(2)]
    request = SampleRequest(*prompts(), SAMPLING, [2], StopRule(), 0, 2)
    for engine in engines:
        engine.load(policy.state_dict().items(), "run:1")
    first, again = (engines[0].sample_many([request])[0].response_ids for _ in range(2))
    assert torch.equal(first, engines[1].sample_many([request])[0].response_ids) and not torch.equal(first, again)


def test_a_push_in_flight_splits_a_response_between_two_versions():
    """A push (``in_flight``: ``/pause``, the push, ``/resume``) that lands while a 32-token generation is held after
    10 decode steps: the first 10 tokens of every row were sampled by the old weights, the rest by the new ones
    (``token_versions``), and each part's ``sampling_logprobs`` are the log-probs of its tokens under its own weights
    (teacher forcing; the KV cache is recomputed at the swap)."""
    old, new = (build_causal_lm(model_config("llama"), seed=s).eval() for s in (0, 1))
    paused, resume, at, engines = threading.Event(), threading.Event(), 10, []
    hold = decoder_hold(at, paused, resume, engines)

    ids, mask = prompts()
    generation = dataclasses.replace(SAMPLING, max_new_tokens=32, temperature=1.0)
    answer = {}
    with http_hf_server(model_config("llama"), on_engine=hold) as port:
        fleet = fleet_of_one(port)
        try:
            fleet.sync(old, 1)
            request = SampleRequest(ids, mask, generation, [], StopRule(), 0, 2, seed=5)
            sampling = threading.Thread(target=lambda: answer.update(rows=fleet.sample(request)))
            sampling.start()
            assert paused.wait(60)
            assert fleet.push(policy_weights(new), 2, in_flight=True)  # answered while the batch is held
            assert engines[0].staged is not None  # taken in before the decoder's next forward
            resume.set()
            sampling.join(60)
        finally:
            resume.set()
            fleet.close()
    rows = answer["rows"]
    assert rows.response_ids.shape == (4, 32)
    assert (rows.token_versions[:, :at] == 1).all() and (rows.token_versions[:, at:] == 2).all()
    before = trainer_logprobs(old, ids, mask, rows, 1.0)
    after = trainer_logprobs(new, ids, mask, rows, 1.0)
    torch.testing.assert_close(rows.sampling_logprobs[:, :at], before[:, :at], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows.sampling_logprobs[:, at:], after[:, at:], atol=1e-5, rtol=0)
    assert not torch.allclose(before[:, at:], after[:, at:], atol=1e-3)  # the two versions do differ there


def test_a_newer_version_serves_a_request_that_allows_it():
    """Held step 4: a request for step 3 is served by it with ``newer`` (the free schedule's ``at_least``); without,
    no server holds step 3 and the fleet of one says so in one line."""
    policy = build_causal_lm(model_config("llama"), seed=0).eval()
    ids, mask = prompts()
    with http_hf_server(model_config("llama")) as port:
        fleet = fleet_of_one(port)
        try:
            fleet.sync(policy, 4)
            fleet.version, fleet.at_least = "run:3", True
            rows = fleet.sample(SampleRequest(ids, mask, SAMPLING, [2], StopRule(), 0, 1, seed=1))
            assert set(rows.token_versions[rows.token_versions >= 0].tolist()) == {4}
            fleet.at_least = False
            with pytest.raises(GenerationServerError, match="while sampling with the weights of step 3"):
                fleet.sample(SampleRequest(ids, mask, SAMPLING, [2], StopRule(), 0, 1, seed=1))
        finally:
            fleet.close()


def test_the_hf_engine_serves_a_teachers_own_weights(tmp_path):
    """The HF server with ``--teacher --model FOLDER`` (``load_teacher``): the engine holds the folder's weights,
    and its prompt log-probs are the teacher's own (temperature 1, 0 on the padding)."""
    teacher = build_causal_lm(model_config("qwen2"), seed=2).eval()
    teacher.save_pretrained(tmp_path)
    engine = HFServerEngine(meta_model(str(tmp_path), None), seed=0)
    load_teacher(engine, str(tmp_path))
    ids, mask = prompts()
    rows = torch.cat([ids, torch.tensor([[7, 8, 2], [9, 2, 0]])], 1)
    rows_mask = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 1, 0]])], 1)
    with torch.no_grad():
        expected = response_logps(teacher, rows, rows_mask, 6).logprobs
    assert engine.version == f"teacher {tmp_path}"
    torch.testing.assert_close(engine.prompt_logprobs(rows, rows_mask, 6), expected, atol=1e-5, rtol=0)
