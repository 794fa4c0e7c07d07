"""A fleet of three servers of two engines (``generation.server: {urls: [...]}``: two HF servers and one ``vllm
serve``, all speaking the engine's HTTP routes): RLOO with the KL in the reward, on rollouts one version old
(``max_staleness: 1``), reaches the one-token bandit's closed-form optimum (``tests/helpers/bandit.py``). The
servers are started here with one token for all (as a user starts N servers with one
``AITRAINING_PL_SERVER_TOKEN``); the bandit's eight-word model is not the one of ``test_vllm_http.py``'s server."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

pytest.importorskip("vllm")

from aitraining_pl.generation.config import VLLMConfig  # noqa: E402
from aitraining_pl.generation.servers import auth  # noqa: E402
from aitraining_pl.generation.servers.start import spawn  # noqa: E402
from aitraining_pl.models import build_causal_lm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_fleet_of_two_hf_servers_and_one_vllm_serve_reaches_the_bandit_optimum(tmp_path, monkeypatch):
    from bandit import POLICY, train_bandit, word_tokenizer

    token = auth.new_token()
    monkeypatch.setattr(auth, "new_token", lambda: token)
    monkeypatch.setenv(auth.TOKEN_ENV, token)
    policy = build_causal_lm(POLICY)
    servers = []
    try:
        for i, engine in enumerate(("vllm", "hf", "hf")):
            folder = tmp_path / f"server-{i}"
            folder.mkdir()
            policy.config.save_pretrained(folder)
            word_tokenizer(folder)
            options = VLLMConfig(max_model_len=64, enforce_eager=True, cpu_kv_cache_gb=1)
            servers.append(spawn(engine, folder, options=options, dtype="float32", threads=1, trainer_gpus=0))
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda server: server.wait_ready(300), servers))
        print(f"servers up in {time.perf_counter() - start:.1f} s")
        urls = [server.url for server in servers]
        start = time.perf_counter()
        policy, optimum = train_bandit(tmp_path, "rloo", "hf", steps=20, server={"urls": urls}, max_staleness=1)
        print(f"trained in {time.perf_counter() - start:.1f} s")
    finally:
        for server in servers:
            server.stop()
    tv = 0.5 * float((policy - optimum).abs().sum())
    print(f"fleet of {len(urls)} (vllm, hf, hf), max_staleness 1: total variation {tv:.4f}")
    assert tv < 0.1, (policy, optimum)
    assert torch.isfinite(policy).all()
