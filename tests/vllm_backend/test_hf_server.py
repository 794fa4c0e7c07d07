"""The generation server with the HF decoder as its engine (``aitraining-pl serve --engine hf``, ``HFServerEngine``),
in the main venv (no vLLM): a pushed policy samples as ``HFBackend`` does with the policy itself, a push that lands
mid-generation (``in_flight``) splits a response between two weight versions with each token's log-prob under its
own, ``newer`` requests, the multi-rank load gate, the teacher mode, and the command itself."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from architectures import model_config
from server_fixtures import SPEC, GatedEngine, options, served, serving

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.hf.backend import HFBackend
from aitraining_pl.generation.servers.client import VLLMServerClient
from aitraining_pl.generation.servers.hf_server import HFServerEngine
from aitraining_pl.generation.servers.serve import build_engine, meta_model, parser
from aitraining_pl.generation.servers.tcp_guards import Limits
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.weights import policy_weights
from aitraining_pl.rollout import GenerationConfig

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.7)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of the tiny vocabulary (96 ids; 0 pads, 2 ends)."""
    ids = torch.tensor([[5, 17, 33, 8, 41, 12], [0, 0, 9, 60, 27, 3]])
    return ids, (ids != 0).long()


def engine_for(name: str) -> HFServerEngine:
    return HFServerEngine(meta_model(json.dumps(model_config(name)), None), seed=0)


def trainer_logprobs(model, prompt_ids, prompt_mask, sampled, temperature: float) -> torch.Tensor:
    """(N, R) the trainer's log-probs of the sampled tokens (teacher forcing), 0 after each end."""
    group = torch.arange(prompt_ids.shape[0]).repeat_interleave(sampled.response_ids.shape[0] // prompt_ids.shape[0])
    inside = (sampled.token_versions >= 0).long()
    ids = torch.cat([prompt_ids[group], sampled.response_ids], 1)
    mask = torch.cat([prompt_mask[group], inside], 1)
    with torch.no_grad():
        return response_logps(model, ids, mask, prompt_ids.shape[1], temperature).logprobs * inside


@pytest.mark.parametrize(
    "name, drop_ended",
    [("llama", True), ("qwen2", True), ("gpt2", True), ("llama", False)],  # gpt2: tied embeddings, learned positions
)
def test_a_pushed_policy_samples_as_the_policy_itself(name, drop_ended):
    """After a push, a seeded request is drawn token for token as ``HFBackend`` draws it from the policy at the same
    seed (by the decoder, or by ``generate`` without ``drop_ended``); its ``sampling_logprobs`` are the trainer's
    log-probs of those tokens (fp32) and every token carries the pushed step."""
    policy = build_causal_lm(model_config(name), seed=3).eval()
    ids, mask = prompts()
    generation = dataclasses.replace(SAMPLING, drop_ended=drop_ended)
    with serving(engine_for(name), policy) as port:
        client = VLLMServerClient(policy, options(port))
        try:
            assert client.sync(policy, 7) and not client.sync(policy, 7)  # the held version is not pushed again
            served_rows = client.sample(SampleRequest(ids, mask, generation, [2], StopRule(), 0, 3, seed=11))
            assert client.kind == "HF server"  # how its messages name the server (``ready`` says the engine)
        finally:
            client.close()
    own = HFBackend(policy).sample(SampleRequest(ids, mask, generation, [2], StopRule(), 0, 3, seed=11))
    assert torch.equal(served_rows.response_ids, own.response_ids)
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
    """A push (``in_flight``) that lands while a 32-token generation is paused after 10 decode steps: the first 10
    tokens of every row were sampled by the old weights, the rest by the new ones (``token_versions``), and each
    part's ``sampling_logprobs`` are the log-probs of its tokens under its own weights (teacher forcing; the KV cache
    is recomputed at the swap)."""
    old, new = (build_causal_lm(model_config("llama"), seed=s).eval() for s in (0, 1))
    engine, paused, resume, at = engine_for("llama"), threading.Event(), threading.Event(), 10

    def pause(column: int) -> None:
        if column == at and not paused.is_set():
            paused.set()
            assert resume.wait(60), "the test never resumed the decoder"

    engine.before_forward = pause
    ids, mask = prompts()
    generation = dataclasses.replace(SAMPLING, max_new_tokens=32, temperature=1.0)
    answer = {}
    with serving(engine, old) as port:
        client = VLLMServerClient(old, options(port))
        try:
            client.sync(old, 1)
            sampling = threading.Thread(
                target=lambda: answer.update(
                    rows=client.sample(SampleRequest(ids, mask, generation, [], StopRule(), 0, 2, seed=5))
                )
            )
            sampling.start()
            assert paused.wait(60)
            assert client.push(policy_weights(new), 2, in_flight=True)  # answered while the batch is paused
            assert engine.staged is not None and engine.version == f"{client.run}:1"
            resume.set()
            sampling.join(60)
        finally:
            resume.set()
            client.close()
    rows = answer["rows"]
    assert rows.response_ids.shape == (4, 32)
    assert (rows.token_versions[:, :at] == 1).all() and (rows.token_versions[:, at:] == 2).all()
    before = trainer_logprobs(old, ids, mask, rows, 1.0)
    after = trainer_logprobs(new, ids, mask, rows, 1.0)
    torch.testing.assert_close(rows.sampling_logprobs[:, :at], before[:, :at], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows.sampling_logprobs[:, at:], after[:, at:], atol=1e-5, rtol=0)
    assert not torch.allclose(before[:, at:], after[:, at:], atol=1e-3)  # the two versions do differ there


def test_a_newer_version_serves_a_request_that_allows_it():
    """Held step 4: a request for step 3 is served by it with ``newer`` (``at_least``), refused after the server's
    timeout without."""
    policy = build_causal_lm(model_config("llama"), seed=0).eval()
    ids, mask = prompts()
    with serving(engine_for("llama"), policy, limits=Limits(timeout=2.0)) as port:
        client = VLLMServerClient(policy, options(port))
        try:
            client.sync(policy, 4)
            client.version, client.at_least = f"{client.run}:3", True
            rows = client.sample(SampleRequest(ids, mask, SAMPLING, [2], StopRule(), 0, 1, seed=1))
            assert set(rows.token_versions[rows.token_versions >= 0].tolist()) == {4}
            client.at_least = False
            with pytest.raises(GenerationServerError, match=r"weights \S+:3 did not arrive within 2 s \(held: \S+:4\)"):
                client.sample(SampleRequest(ids, mask, SAMPLING, [2], StopRule(), 0, 1, seed=1))
        finally:
            client.close()


def test_a_load_waits_for_the_other_ranks_request_at_the_held_version():
    """Two ranks hold weights 1; rank 1's request for them is still queued (the engine is busy with rank 0's) when
    rank 0 pushes weights 2 from a second connection: rank 1 is served with weights 1, and the load happens only
    once rank 1 asks for weights 2, which then serve it."""
    model = build_causal_lm(SPEC, seed=0)
    engine, ids, mask = GatedEngine(), *prompts()
    generate = dataclasses.replace(SAMPLING, max_new_tokens=2)
    with served(engine, model) as server:
        first, second = (VLLMServerClient(model, options(server.server_address[1]), r, "run") for r in (0, 1))
        answers = {}

        def sample(client, key):
            return threading.Thread(
                target=lambda: answers.update(
                    {key: client.sample(SampleRequest(ids, mask, generate, [2], StopRule(), 0, 1))}
                )
            )

        try:
            first.sync(model, 1)
            second.sync(model, 1)
            engine.gate.clear()
            threads = [sample(first, "first")]
            threads[0].start()
            assert engine.entered.wait(60)  # rank 0's batch generates (and holds the server's lock)
            threads.append(sample(second, "second"))
            threads[1].start()
            wait_until(lambda: any(s.rank == 1 and s.latest == 1 for s in server.queue.seats.values()))
            pushing = threading.Thread(target=first.push, args=(policy_weights(model), 2))
            pushing.start()  # rank 0's first connection is busy: the push goes over its second one
            wait_until(server.pushing.locked)
            engine.gate.set()
            for thread in threads:
                thread.join(60)
            assert [v for v, _ in engine.served] == ["run:1", "run:1"] and len(engine.pushes) == 1
            assert pushing.is_alive()  # held at the gate: rank 1's latest request is still at weights 1
            second.sync(model, 2)
            rows = second.sample(SampleRequest(ids, mask, generate, [2], StopRule(), 0, 1))
            pushing.join(60)
            assert len(engine.pushes) == 2 and engine.served[-1][0] == "run:2"
            assert (answers["second"].token_versions == 1).all() and (rows.token_versions == 2).all()
        finally:
            engine.gate.set()
            first.close()
            second.close()


def test_the_synchronous_two_rank_loop_is_unchanged_by_the_load_gate(capfd):
    """Two ranks in lockstep (a barrier stands for the optimizer step), rank 0 pushing each step's weights: every
    rollout of both ranks is drawn by one batch from that step's weights, and no load waits out the gate (the other
    rank asks for the new weights right after the push began)."""
    model = build_causal_lm(SPEC, seed=0)
    engine, (ids, mask), barrier, records = GatedEngine(), prompts(), threading.Barrier(2), {0: [], 1: []}
    generate = dataclasses.replace(SAMPLING, max_new_tokens=2)
    with served(engine, model, limits=Limits(timeout=30.0), batch_wait=30.0) as server:
        clients = [VLLMServerClient(model, options(server.server_address[1]), r, "run") for r in (0, 1)]

        def loop(client):
            for step in (1, 2, 3):
                barrier.wait(60)
                client.sync(model, step)
                rows = client.sample(SampleRequest(ids, mask, generate, [2], StopRule(), 0, 1))
                records[client.rank].append((client.batched, set(rows.token_versions.flatten().tolist())))

        try:
            threads = [threading.Thread(target=loop, args=(c,)) for c in clients]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        finally:
            for client in clients:
                client.close()
    assert records[0] == records[1] == [(2, {1}), (2, {2}), (2, {3})]
    assert engine.served == [("run:1", 2), ("run:2", 2), ("run:3", 2)] and len(engine.pushes) == 3
    assert "loading the push anyway" not in capfd.readouterr().err


def wait_until(condition, timeout: float = 60.0) -> None:
    """Return once ``condition()`` holds (checked every 10 ms), failing after ``timeout`` seconds."""
    event = threading.Event()
    for _ in range(int(timeout * 100)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("the condition never held")


def test_the_hf_engine_serves_a_teachers_own_weights(tmp_path):
    """``serve --engine hf --teacher --model FOLDER``: the engine holds the folder's weights, and its prompt
    log-probs are the teacher's own (temperature 1, 0 on the padding)."""
    teacher = build_causal_lm(model_config("qwen2"), seed=2).eval()
    teacher.save_pretrained(tmp_path)
    args = parser("serve").parse_args(["--engine", "hf", "--teacher", "--model", str(tmp_path)])
    engine = build_engine(args, meta_model(str(tmp_path), None), None)
    ids, mask = prompts()
    rows = torch.cat([ids, torch.tensor([[7, 8, 2], [9, 2, 0]])], 1)
    rows_mask = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 1, 0]])], 1)
    with torch.no_grad():
        expected = response_logps(teacher, rows, rows_mask, 6).logprobs
    assert engine.version == f"teacher {tmp_path}"
    torch.testing.assert_close(engine.prompt_logprobs(rows, rows_mask, 6), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_serve_with_the_hf_engine_starts_serves_and_stops_on_sigterm(tmp_path, monkeypatch):
    """``aitraining-pl serve --engine hf`` started by ``serve.launch``: it takes a push, serves one sample, and a
    SIGTERM ends it (no process left)."""
    from aitraining_pl.generation.servers.serve import launch

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    argv = ["--engine", "hf", "--model", json.dumps(SPEC), "--tokenizer", "byte", "--port", "0", "--threads", "1"]
    proc, port = launch(argv, tmp_path / "serve.log")
    try:
        policy = build_causal_lm(SPEC, seed=0).eval()
        client = VLLMServerClient(policy, options(port))
        try:
            client.sync(policy, 1)
            rows = client.sample(SampleRequest(*prompts(), SAMPLING, [2], StopRule(), 0, 2, seed=3))
        finally:
            client.close()
        assert rows.response_ids.shape[0] == 4 and (rows.token_versions[:, 0] == 1).all()
    finally:
        proc.terminate()
        status = proc.wait(60)
    assert status == 0, (tmp_path / "serve.log").read_text()[-2000:]
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    assert "serve: listening on" in (tmp_path / "serve.log").read_text()


def test_the_command_names_and_threads(monkeypatch):
    """``serve``'s ``--engine`` defaults to vLLM; ``--threads`` parses."""
    args = parser("serve").parse_args(["--model", "tiny-llama", "--threads", "2"])
    assert args.engine == "vllm" and args.threads == 2
    assert isinstance(parser().parse_args(["--model", "m", "--engine", "hf"]), argparse.Namespace)
