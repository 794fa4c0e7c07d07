"""Hostile requests at the HF server (issue 52, items 4, 9, 10), in process (``http_fixtures.http_hf_server`` with small
bounds): a body over ``--max_body_mb`` is a 413 before it is parsed, too many prompts or prompts x n a 400; NaN
sampling fields and stop ids of 10**20 a 4xx with a JSON body, never a 500; a corrupt or truncated pushed file and
LoRA configs with a bad ``r`` or ``lora_alpha`` are ``ok: false`` and the previous weights keep serving; and a launched
server's parent watch is armed before torch is imported, so a SIGTERM during the heavy imports removes its folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
from http_fixtures import SPEC, saved_policy

from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.auth import FOLDER_ENV, PARENT_ENV
from aitraining_pl.generation.servers.http import SHARED_MEMORY, HTTPReplica
from aitraining_pl.generation.servers.vllm_worker import PUSH_PREFIX
from aitraining_pl.generation.version import WeightsVersion

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "hostile-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
BOUNDS = {"max_body_mb": 0.01, "max_prompts": 8, "max_samples": 16}  # 10 kB, 8 prompts, 16 responses
GREEDY = GenerationConfig(max_new_tokens=4, do_sample=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from http_fixtures import http_hf_server

    model = saved_policy(tmp_path_factory.mktemp("policy"))
    with http_hf_server(SPEC, token=TOKEN, **BOUNDS) as port:
        url = f"http://127.0.0.1:{port}"
        replica = HTTPReplica(url, TOKEN)
        replica.push(model.state_dict().items(), WeightsVersion("run", 1))
        yield url, replica, model
        replica.close()


def completion(url: str, **fields) -> httpx.Response:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0, **fields}
    return httpx.post(url + "/v1/completions", json=body, headers=HEADERS, timeout=60)


def greedy(replica: HTTPReplica) -> list[list[int]]:
    ids = torch.tensor([[5, 17, 33]])
    request = SampleRequest(ids, torch.ones_like(ids), GREEDY, [1], StopRule(None), 0, 1, None)
    return replica.sample(request, time.monotonic() + 60).response_ids.tolist()


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    url, _, _ = served
    big = json.dumps({"prompt": [5] * 6000, "max_tokens": 1}).encode()  # 18 kB
    declared = httpx.post(url + "/v1/completions", content=big, headers={**HEADERS, "content-type": "application/json"})
    streamed = httpx.post(url + "/v1/completions", content=iter([big[:9000], big[9000:]]),
                          headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
    for answer in (declared, streamed):  # with and without a Content-Length
        assert answer.status_code == 413 and "max_body_mb" in answer.json()["error"]
    assert httpx.post(url + "/v1/completions", content=big).status_code == 401  # a stranger: 401 first


def test_too_many_prompts_or_responses_is_400(served):
    url, _, _ = served
    many = completion(url, prompt=[[5, 6]] * 9)
    assert many.status_code == 400 and "--max_prompts 8" in many.text
    wide = completion(url, prompt=[[5, 6]] * 4, n=5, temperature=1.0)  # 20 responses
    assert wide.status_code == 400 and "--max_samples 16" in wide.text
    within = completion(url, prompt=[[5, 6]] * 4, n=4, temperature=1.0)
    assert within.status_code == 200 and len(within.json()["choices"]) == 16


@pytest.mark.parametrize("fields", [{"temperature": float("nan")}, {"top_p": float("nan")},
                                    {"temperature": float("inf")}, {"stop_token_ids": [10**20]},
                                    {"top_k": 10**20}, {"max_tokens": 10**20}])  # fmt: skip
def test_nan_and_huge_sampling_fields_are_4xx_with_a_json_body(served, fields):
    url, _, _ = served
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, **fields})  # json.dumps writes NaN as vLLM's clients do
    answer = httpx.post(url + "/v1/completions", content=body, headers={**HEADERS, "content-type": "application/json"})
    assert 400 <= answer.status_code < 500, answer.text
    assert next(iter(fields)) in answer.json()["error"]


def rpc(url: str, method: str, path: str, owner: str, version: str) -> dict:
    body = {"method": method, "kwargs": {"path": path, "version": version, "owner": owner}}
    answer = httpx.post(url + "/collective_rpc", json=body, headers=HEADERS, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["results"][0]


def push_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None))


def test_corrupt_pushes_and_bad_lora_configs_are_refused_and_the_weights_kept(served):
    from safetensors.torch import save_file

    url, replica, model = served
    before = greedy(replica)
    folder = push_folder()
    try:
        whole = folder / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(whole))
        data = whole.read_bytes()
        for name, content in (("truncated", data[: len(data) // 2]), ("corrupt", os.urandom(4096))):
            (folder / f"{name}.safetensors").write_bytes(content)
            result = rpc(url, "aitraining_pl_load", str(folder / f"{name}.safetensors"), replica.owner, "run:2")
            assert result["ok"] is False and "cannot be read" in result["error"], result
        save_file({"x": torch.zeros(1)}, str(folder / "adapter_model.safetensors"))
        for config, field in (({"r": "abc"}, "rank r"), ({"r": None}, "rank r"), ([4, 8], "not an object"),
                              ({"r": 4, "lora_alpha": "x"}, "lora_alpha")):  # fmt: skip
            (folder / "adapter_config.json").write_text(json.dumps(config))
            result = rpc(url, "aitraining_pl_load_adapter", str(folder), replica.owner, "run:1")
            assert result["ok"] is False and field in result["error"], (config, result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert greedy(replica) == before  # the previous weights keep serving


def test_a_sigterm_during_the_heavy_imports_removes_the_launched_server_s_folder(tmp_path):
    """Item 10: the trainer's death (its SIGTERM) arrives while ``hf_routes`` still imports torch: the parent watch
    and its cleanup are armed by then, so the server's folder (its token) goes."""
    folder = tmp_path / "server"
    folder.mkdir()
    script = textwrap.dedent("""
        import os, runpy, signal, sys

        class AtTorch:  # the SIGTERM lands when the server module first imports torch
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGTERM)
                return None

        sys.meta_path.insert(0, AtTorch())
        sys.argv = ["hf_routes", "--help"]
        runpy.run_module("aitraining_pl.generation.servers.hf_routes", run_name="__main__")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), PARENT_ENV: str(os.getpid()), FOLDER_ENV: str(folder)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert not folder.exists()
