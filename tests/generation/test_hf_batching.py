"""The HF server decodes the completion requests that arrive together as one batch (``hf_routes.Batcher``,
``HFServerEngine.sample_many``), and a seeded request's tokens are the ones it gets alone."""

from __future__ import annotations

import threading
import time

import torch
from http_fixtures import saved_policy
from server_fixtures import SPEC

from aitraining_pl.generation.backend import HFBackend, SampleRequest
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.hf_routes import Batcher
from aitraining_pl.generation.servers.hf_server import HFServerEngine
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.generation import StopRule

SAMPLED = GenerationConfig(max_new_tokens=12, temperature=1.0)


def one_prompt(tokens, seed, generation=SAMPLED, num_samples=3):
    ids = torch.tensor([tokens])
    return SampleRequest(ids, torch.ones_like(ids), generation, [1], StopRule(None), 0, num_samples, seed)


def test_requests_decoded_together_draw_the_tokens_each_draws_alone(tmp_path):
    model = saved_policy(tmp_path)
    with torch.device("meta"):
        engine = HFServerEngine(build_causal_lm(SPEC), device="cpu")
    engine.load(model.state_dict().items(), "run:1")
    greedy = GenerationConfig(max_new_tokens=5, do_sample=False)
    requests = [one_prompt([5, 17, 33], 3), one_prompt([9, 60, 27, 3, 44], 4), one_prompt([9, 60], None, greedy)]
    together = engine.sample_many(requests)
    alone = [engine.sample_many([request])[0] for request in requests[:2]]
    for both, single in zip(together, alone):
        assert torch.equal(both.response_ids, single.response_ids)
        torch.testing.assert_close(both.sampling_logprobs, single.sampling_logprobs)
    # a request alone draws what the policy draws itself with its seed (HFBackend: torch.manual_seed)
    own = HFBackend(model).sample(requests[0])
    width = own.response_ids.shape[1]
    assert torch.equal(alone[0].response_ids[:, :width], own.response_ids)
    assert together[2].response_ids.shape[0] == 3 and not torch.equal(alone[0].response_ids, alone[1].response_ids)


def test_requests_are_served_alone_in_arrival_order_unless_a_wait_is_set():
    calls = []

    def serve(requests, vision=None):
        calls.append(list(requests))
        time.sleep(0.05)
        return [f"answer {r}" for r in requests]

    for wait, expected in ((0.0, 5), (0.3, 1)):
        calls.clear()
        batcher, answers = Batcher(serve, wait_s=wait), {}
        threads = [threading.Thread(target=lambda i=i: answers.update({i: batcher.submit([i, i + 10])}))
                   for i in range(5)]  # fmt: skip
        for thread in threads:
            thread.start()
            time.sleep(0.01)
        for thread in threads:
            thread.join(10)
        assert answers == {i: [f"answer {i}", f"answer {i + 10}"] for i in range(5)}
        assert len(calls) == expected  # without a wait each HTTP request is its own batch; with one, all five share


def test_an_error_reaches_every_request_of_its_batch():
    def serve(requests, vision=None):
        raise RuntimeError("engine failed")

    batcher = Batcher(serve)
    try:
        batcher.submit([1])
    except RuntimeError as err:
        assert "engine failed" in str(err)
    else:
        raise AssertionError("the error was not raised")
    assert not batcher.busy
