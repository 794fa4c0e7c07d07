"""Shared by the Tinker-server tests and benchmark: a tiny causal LM with the byte tokenizer saved to a folder, and a
``tinker-serve`` on loopback over it with two API keys (two tenants)."""

from __future__ import annotations

import contextlib
import os

import torch
import transformers

from aitraining_pl.models import build_causal_lm

KEYS = ("tml-test-key-one", "tml-test-key-two")


def saved_model(folder, spec: dict | None = None, seed: int = 0) -> str:
    """A tiny random Llama (``spec``: ``build_causal_lm``'s; default ``tiny-llama``) and ``ByT5Tokenizer`` saved
    to ``folder``; returns the folder."""
    torch.manual_seed(seed)
    model = build_causal_lm(spec or {"preset": "tiny-llama", "num_attention_heads": 2, "num_key_value_heads": 1})
    model.save_pretrained(folder)
    transformers.ByT5Tokenizer().save_pretrained(folder)
    return str(folder)


@contextlib.contextmanager
def tinker_server(folder: str, checkpoint_dir: str, **limits):
    """A ``tinker-serve`` of ``folder`` on loopback (a thread of this process); yields ``(base_url, state)``."""
    from aitraining_pl.tinker.serve import make_state, start_in_thread
    from aitraining_pl.tinker.server import build_app

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    state = make_state(folder, checkpoint_dir=str(checkpoint_dir), **limits)
    server, url = start_in_thread(build_app(state, list(KEYS)))
    try:
        yield url, state
    finally:
        server.should_exit = True
        state.engine.worker.shutdown(wait=False, cancel_futures=True)
        if state.sampler.served is not None:  # its launched generation servers
            state.sampler.served.close()
