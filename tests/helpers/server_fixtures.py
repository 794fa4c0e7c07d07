"""Shared by the generation-server tests: the vLLM-servable tiny model, the client's options, and a
``GenerationServer`` served from a thread around a stand-in engine (no vLLM needed)."""

from __future__ import annotations

import contextlib
import threading

from aitraining_pl.generation.config import VLLMConfig

#: tiny-llama with two heads of 32 (vLLM's CPU attention has no kernel for heads of 16)
SPEC = {"preset": "tiny-llama", "num_attention_heads": 2, "num_key_value_heads": 1}


def options(port: int, **kw) -> VLLMConfig:
    return VLLMConfig(mode="server", server_port=port, **{"server_timeout": 60, "protocol": "tcp", **kw})


class RecordingEngine:
    """Stands in for ``VLLMEngine`` in a ``GenerationServer`` without vLLM: keeps the pushed tensors; its
    ``fail_at`` push stops after one tensor with a lost connection (the server then closes the connection)."""

    def __init__(self, fail_at: int = -1):
        self.version, self.pushes, self.fail_at = None, [], fail_at

    def load(self, weights, version):
        received = {}
        for name, tensor in weights:
            received[name] = tensor.clone()
            if len(self.pushes) == self.fail_at:
                raise ConnectionError("the engine went away")
        self.pushes.append(received)
        self.version = version


@contextlib.contextmanager
def serving(engine, model, limits=None, token: str = "test-token"):
    """A ``GenerationServer`` around ``engine`` (a stand-in) for ``model``'s shape, served from a thread on a free
    loopback port (yielded) until the block ends; its ``token`` written where ``vllm-serve`` writes a token it
    generated (a client on loopback finds it there)."""
    with served(engine, model, limits, token) as server:
        yield server.server_address[1]


@contextlib.contextmanager
def served(engine, model, limits=None, token: str = "test-token", batch_wait: float = 0.05):
    """``serving``, yielding the ``GenerationServer`` itself (its port: ``server.server_address[1]``)."""
    from aitraining_pl.generation.servers.tcp_guards import write_token
    from aitraining_pl.generation.servers.tcp_server import GenerationServer

    server = GenerationServer(engine, None, model, "127.0.0.1", 0, token, batch_wait=batch_wait, limits=limits)
    path = write_token(token, server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        path.unlink(missing_ok=True)


class GatedEngine(RecordingEngine):
    """A ``RecordingEngine`` that also samples (zeros): ``served`` records the version held at each
    ``sample_many`` and its number of requests; while ``gate`` is cleared a call sets ``entered`` and waits for it."""

    def __init__(self):
        super().__init__()
        self.served, self.cached_each = [], []
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def sample_many(self, requests):
        import torch

        from aitraining_pl.generation.backend import SampledTokens

        self.served.append((self.version, len(requests)))
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.cached_each = [0] * len(requests)
        rows = [r.prompt_ids.shape[0] * r.num_samples for r in requests]
        return [SampledTokens(torch.zeros(n, 2, dtype=torch.long), sampling_logprobs=torch.zeros(n, 2)) for n in rows]


class ScoringEngine:
    """Stands in for a teacher's ``VLLMEngine`` (``vllm-serve --teacher``) without vLLM: ``prompt_logprobs`` as vLLM
    computes them (each row's unpadded tokens alone, positions from 0, the untruncated softmax at temperature 1), by
    a local HF ``model``, laid out by the engine's own ``place_rows``."""

    def __init__(self, model):
        self.model, self.version = model.eval(), "teacher"

    def prompt_logprobs(self, input_ids, attention_mask, start):
        import torch

        from aitraining_pl.generation.vllm import place_rows, unpadded_rows

        scores = []
        with torch.no_grad():
            for tokens in unpadded_rows(input_ids, attention_mask):
                ids = torch.tensor([tokens])
                logps = self.model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
                scores.append(logps.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return place_rows(scores, attention_mask, start)
