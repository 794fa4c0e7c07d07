"""Shared by the asynchronous-training tests (issue 31): an HF generation server in a thread of the test process."""

from __future__ import annotations

import contextlib

import torch
from server_fixtures import serving


@contextlib.contextmanager
def hf_server_port(model_config, seed: int = 0):
    """An HF generation server (``vllm_backend.hf_engine.HFServerEngine`` behind ``GenerationServer``) for
    ``model_config``'s architecture, served from a thread on a free loopback port (yielded) until the block ends."""
    from aitraining_pl.models.loading import build_causal_lm
    from aitraining_pl.vllm_backend.hf_engine import HFServerEngine

    with torch.device("meta"):
        model = build_causal_lm(model_config)
    with serving(HFServerEngine(model, seed=seed, device="cpu"), model) as port:
        yield port
