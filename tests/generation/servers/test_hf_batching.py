"""The HF server decodes the completion requests that arrive together as one batch (``hf_routes.Batcher``,
``HFServerEngine.sample_many``), and a seeded request's tokens are the ones it gets alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from http_fixtures import SPEC, saved_policy

from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.hf_routes import Batcher
from aitraining_pl.generation.servers.hf_server import HFServerEngine
from aitraining_pl.models import build_causal_lm

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
        # the first columns: a batch of another shape may round a logit differently, and a near tie then flips a
        # token (rare), after which the rows' generators advance differently: never within the first few draws here
        assert torch.equal(both.response_ids[:, :4], single.response_ids[:, :4])
        torch.testing.assert_close(both.sampling_logprobs[:, :4], single.sampling_logprobs[:, :4])
    # seeded: the same again (the draw equals HFBackend's with that seed only up to float rounding: the two paths'
    # kernels may round differently from run to run, and a near tie then flips a token, so that is not asserted)
    assert torch.equal(engine.sample_many([requests[0]])[0].response_ids, alone[0].response_ids)
    assert together[2].response_ids.shape[0] == 3 and not torch.equal(alone[0].response_ids, alone[1].response_ids)


def test_requests_are_served_alone_in_arrival_order_unless_a_wait_is_set():
    for wait in (0.0, 0.05):
        calls, answers, gate, entered = [], {}, threading.Event(), threading.Event()

        def serve(requests, vision=None):
            if requests == ["busy"]:
                entered.set()
                gate.wait(10)  # the engine is busy while the five requests queue
            calls.append(list(requests))
            return [f"answer {r}" for r in requests]

        batcher = Batcher(serve, wait_s=wait)
        threads = [threading.Thread(target=lambda: batcher.submit(["busy"]))]
        threads[0].start()
        entered.wait(10)
        threads += [threading.Thread(target=lambda i=i: answers.update({i: batcher.submit([i, i + 10])}))
                    for i in range(5)]  # fmt: skip
        for thread in threads[1:]:
            thread.start()
        while len(batcher.queue) < 5:
            time.sleep(0.001)
        order = [job["requests"] for job in batcher.queue]
        gate.set()
        for thread in threads:
            thread.join(10)
        assert answers == {i: [f"answer {i}", f"answer {i + 10}"] for i in range(5)}
        if wait:  # all five decode in one batch
            assert calls[1:] == [[r for request in order for r in request]]
        else:  # each HTTP request is its own batch, in arrival order
            assert calls[1:] == order


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


GEMMA_SCALE = "Gemma's embed_scale buffer lives in an embedding not built from a config alone: not recomputed yet"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3", pytest.param("gemma2", marks=pytest.mark.xfail(
    reason=GEMMA_SCALE, strict=True))])  # fmt: skip
def test_the_engine_computes_the_buffers_no_push_carries(model_type):
    """``to_empty`` leaves non-persistent buffers (rotary frequencies) as uninitialised memory, which transformers'
    ``init_weights`` did not set: the engine computes them again, the same as a model built on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64, head_dim=8,
                                  pad_token_id=0)  # fmt: skip
    reference = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        engine = HFServerEngine(AutoModelForCausalLM.from_config(config), device="cpu")
    buffers = dict(engine.model.named_buffers())
    assert buffers
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, msg=name)
