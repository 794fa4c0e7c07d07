"""Shared by the generation-server tests (``tests/generation/servers/``, the served teacher's): the vLLM-servable tiny
model (``SPEC``), the policy saved as a folder a server starts from, a LoRA policy over it whose adapter changes the
greedy samples, and the HF server over HTTP served from a thread (``http_hf_server``)."""

from __future__ import annotations

import contextlib
import copy
import os
import time

import torch
import transformers

from aitraining_pl.models import build_causal_lm

#: tiny-llama with two heads of 32 (vLLM's CPU attention has no kernel for heads of 16)
SPEC = {"preset": "tiny-llama", "num_attention_heads": 2, "num_key_value_heads": 1}


def saved_policy(folder):
    """The tiny policy (``SPEC``, its head sharpened so that greedy never meets a near tie), its config and the byte
    tokenizer saved to ``folder``."""
    torch.manual_seed(0)
    model = build_causal_lm(SPEC).eval()
    with torch.no_grad():  # sharper than the random init: greedy ties are then unlikely
        model.lm_head.weight.mul_(20)
    model.config.save_pretrained(folder)
    transformers.ByT5Tokenizer().save_pretrained(folder)
    return model


def lora_policy(model):
    """A rank-4 LoRA policy over a copy of ``model`` whose adapter changes its greedy samples."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # a delta that changes the greedy samples
    return peft.eval()


@contextlib.contextmanager
def http_hf_server(model_config, seed: int = 0, token: str = "test-token", teacher=None, tokenizer="byte",
                   on_engine=None, **bounds):  # fmt: skip
    """The HF server over HTTP (``hf_routes.build_app`` around an ``HFServerEngine`` for ``model_config``'s
    architecture, the ``tokenizer``, byte-level by default) served by uvicorn from a thread on a free loopback port
    (yielded) until the block ends; ``AITRAINING_PL_SERVER_TOKEN`` set to its ``token`` meanwhile (the trainer reads
    it there). ``teacher``: a model of that architecture whose weights it serves fixed, as ``--teacher`` does.
    ``on_engine(engine)``: called with the engine once the app is built (a test's hooks); ``bounds``: ``build_app``'s
    request bounds (``max_body_mb``, ``max_prompts``, ``max_samples``)."""
    import socket
    import threading

    import uvicorn

    from aitraining_pl.generation.servers.auth import TOKEN_ENV
    from aitraining_pl.generation.servers.checks import WeightSpecs
    from aitraining_pl.generation.servers.hf_routes import build_app
    from aitraining_pl.generation.servers.hf_server import HFServerEngine
    from aitraining_pl.models.loading import load_tokenizer

    with torch.device("meta"):
        model = build_causal_lm(model_config)
    specs = WeightSpecs(model)
    engine = HFServerEngine(model, seed=seed, device="cpu")
    if teacher is not None:
        engine.load(teacher.state_dict().items(), "teacher")
    positions = getattr(model.config, "max_position_embeddings", None)
    app = build_app(engine, load_tokenizer(tokenizer), specs, "policy", positions, token, fixed=teacher is not None,
                    **bounds)  # fmt: skip
    if on_engine is not None:
        on_engine(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    previous = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        if previous is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = previous
