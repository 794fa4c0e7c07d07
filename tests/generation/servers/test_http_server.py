"""The HF server over HTTP (``generation.servers.hf_routes``) and the one client (``HTTPReplica``), in the main venv:
one launched server shared by the module. Every route answers 401 without the run's token; a pushed policy samples
greedily as the policy itself; seeded draws repeat; NaN weights, a wrong shape, a foreign version and another
client's push are refused with one line (no run id in it) and the previous weights keep serving; ``/pause`` holds
generation; an unreachable server is ``ReplicaDown``; a SIGKILLed trainer's server exits and its folder goes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import torch
from http_fixtures import lora_policy, saved_policy

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.generation.hf.backend import HFBackend
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.replica import Replica, ReplicaDown
from aitraining_pl.generation.servers.start import start
from aitraining_pl.generation.version import WeightsVersion

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)
SAMPLED = GenerationConfig(max_new_tokens=8, temperature=1.0)
#: what a launched server answers on, with and without a route behind it: all of it needs the token
ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/collective_rpc"),
          ("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
          ("POST", "/update_weights"), ("GET", "/openapi.json"), ("GET", "/docs"),
          ("POST", "/inference/v1/generate")]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-server")
    model = saved_policy(folder)
    process = start("hf", folder, options=VLLMConfig(), dtype="float32", threads=1, timeout=120)
    replica = HTTPReplica(process.url, process.token)
    replica.push(model.state_dict().items(), WeightsVersion("run-a", 1))
    yield process, replica, model
    replica.close()
    process.stop()


def request(generation, seed=None, num_samples=2):
    ids = torch.tensor([[0, 0, 5, 17, 33], [9, 60, 27, 3, 44]])
    return SampleRequest(ids, (ids != 0).long(), generation, [1], StopRule(None), 0, num_samples, seed)


def test_every_route_answers_401_without_the_token(server):
    process, _, _ = server
    for method, route in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": process.token}):
            answer = httpx.request(method, process.url + route, headers=headers, json={})
            assert answer.status_code == 401, (method, route, headers.keys())
            assert process.token not in answer.text
    assert stat.S_IMODE(os.stat(process.token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(process.folder).st_mode) == 0o700


def test_greedy_samples_are_the_policys_and_seeded_ones_repeat(server):
    _, replica, model = server
    assert isinstance(replica, Replica)
    asked = request(GREEDY)
    greedy = replica.sample(asked, time.monotonic() + 60)
    for row, (ids, mask) in enumerate(zip(asked.prompt_ids, asked.prompt_mask)):
        alone = ids[mask.bool()][None]
        own = HFBackend(model).sample(SampleRequest(alone, torch.ones_like(alone), GREEDY, [1], StopRule(None), 0))
        for sample in (2 * row, 2 * row + 1):
            length = own.response_ids.shape[1]
            assert greedy.response_ids[sample, :length].tolist() == own.response_ids[0].tolist()
    first, again = (replica.sample(request(SAMPLED, seed=3), time.monotonic() + 60) for _ in range(2))
    other = replica.sample(request(SAMPLED, seed=4), time.monotonic() + 60)
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.sampling_logprobs, again.sampling_logprobs)
    assert not torch.equal(first.response_ids, other.response_ids)
    assert replica.outstanding_tokens() == 0 and replica.stats.requests >= 8


def test_refused_pushes_keep_the_previous_weights_serving(server):
    _, replica, model = server
    before = replica.sample(request(GREEDY), time.monotonic() + 60).response_ids
    weights = dict(model.state_dict())
    nan = {**weights, "model.norm.weight": torch.full_like(weights["model.norm.weight"], float("nan"))}
    short = {**weights, "model.norm.weight": weights["model.norm.weight"][:-1]}
    zeros = {name: torch.zeros_like(t) for name, t in weights.items()}
    thief = HTTPReplica(replica.url, server[0].token)  # holds the token, not the run's push key
    cases = [
        (replica, nan, WeightsVersion("run-a", 2), "'model.norm.weight' has 64 non-finite values"),
        (replica, short, WeightsVersion("run-a", 3), "'model.norm.weight' has shape [63], the served model's is [64]"),
        (replica, zeros, WeightsVersion("run-b", 4), "weights version run-b:4 is not of the run that owns"),
        (replica, zeros, WeightsVersion("run-a", 1), "is not newer than the last push"),
        (thief, zeros, WeightsVersion("run-a", 9), "the server's weights belong to another training run"),
    ]
    for client, pushed, version, line in cases:
        with pytest.raises(GenerationServerError, match="the previous weights keep serving") as refused:
            client.push(pushed.items(), version)
        assert line in str(refused.value) and "run-a" not in str(refused.value).replace(str(version), "")
    thief.close()
    assert torch.equal(replica.sample(request(GREEDY), time.monotonic() + 60).response_ids, before)
    assert replica.served_version() == WeightsVersion("run-a", 1)


def test_pause_holds_generation_until_resume(server):
    _, replica, _ = server
    replica.pause()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (replica.sample(request(GREEDY), time.monotonic() + 60), done.set()))
    worker.start()
    assert not done.wait(1.0)
    replica.resume()
    assert done.wait(30)
    worker.join()


def test_an_unreachable_server_is_replica_down():
    replica = HTTPReplica("http://127.0.0.1:9", "token")
    with pytest.raises(ReplicaDown, match="cannot reach the server"):
        replica.sample(request(GREEDY), time.monotonic() + 5)
    assert not replica.alive()
    replica.close()


TRAINER = """
import sys, time
from pathlib import Path
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers.start import start
server = start("hf", Path(sys.argv[1]), options=VLLMConfig(), dtype="float32", threads=1, timeout=120)
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_trainers_server_exits_and_its_folder_goes(tmp_path):
    """Issue 40, probe 3: the launched server outlived a SIGKILLed trainer (parent 1, still listening)."""
    folder = tmp_path / "launched"
    folder.mkdir()
    saved_policy(folder)
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAINER), str(folder)], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    pid = int(trainer.stdout.readline())
    assert (folder / "token").is_file()
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (folder.exists() or _alive(pid)):
        time.sleep(0.1)
    assert not _alive(pid), "the server outlived its trainer"
    assert not folder.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat_file:  # a zombie (not yet reaped by init) has exited
        return stat_file.read().split()[2] != "Z"


def test_lora_adapter_pushes_sample_as_merged_pushes(server):
    """Issue 38, part 4: the base once, then the adapter alone; the same greedy samples as a merged push."""
    from aitraining_pl.generation.servers.fleet import Fleet
    from aitraining_pl.models.lora import plain_weights
    from aitraining_pl.models.weights import policy_weights

    _, replica, model = server
    peft = lora_policy(model)
    backend = Fleet([replica], policy_weights, run="run-a", connect_timeout=60, token_timeout=0.0)
    args = request(GREEDY)
    plain = backend.sample(
        SampleRequest(args.prompt_ids, args.prompt_mask, GREEDY, [1], StopRule(None), 0, 2)
    ).response_ids
    assert backend.sync(peft, 5) and backend.members[0].base_pushed
    adapted = backend.sample(
        SampleRequest(args.prompt_ids, args.prompt_mask, GREEDY, [1], StopRule(None), 0, 2)
    ).response_ids
    base_push, adapter_push = replica.stats.pushes[-2:]
    replica.push(plain_weights(peft, merged=True), WeightsVersion("run-a", 6))
    merged = replica.sample(args, time.monotonic() + 60).response_ids
    assert torch.equal(adapted, merged) and not torch.equal(adapted, plain)
    full = replica.stats.pushes[-1].bytes
    print(f"push bytes: full {full}, adapter {adapter_push.bytes} ({adapter_push.bytes / full:.2%})")
    assert base_push.bytes == full and adapter_push.bytes < 0.05 * full


def test_an_open_server_other_machines_reach_is_refused_unless_allowed(monkeypatch):
    """Issue 38, part 5: a non-loopback server without the token middleware stops the run before training."""
    import http.server
    import warnings

    from aitraining_pl.errors import ConfigError
    from aitraining_pl.generation.servers import auth

    class Open(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Open)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(auth, "is_loopback", lambda host: False)  # as if on another machine
    replica = HTTPReplica(f"http://127.0.0.1:{server.server_address[1]}", None)
    try:
        with pytest.raises(ConfigError, match="answers without a token and other machines can reach it"):
            auth.check_guarded(replica.url, allow=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auth.check_guarded(replica.url, allow=True)
            auth.check_guarded(replica.url, allow=True)
        assert len([w for w in caught if "takes requests without a token" in str(w.message)]) == 1
    finally:
        replica.close()
        server.shutdown()


def test_vllm_serve_launches_vllms_own_server_with_the_flags_and_a_token(tmp_path, monkeypatch):
    """``aitraining-pl vllm-serve`` (one release): ``vllm serve`` with the middleware, the worker extension and dev
    mode; a token of its own on loopback, owner-only where the trainer looks; another host needs one given. With
    ``--teacher``: the checkpoint's own weights (no dummy load) and no worker extension (no pushes)."""
    from aitraining_pl.errors import ConfigError
    from aitraining_pl.generation.servers import auth
    from aitraining_pl.generation.servers.vllm_serve import command

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    argv, env, where = command(["--model", "m", "--port", "8123", "--dtype", "bfloat16", "--data-parallel-size", "2"])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[-4:] == ["--dtype", "bfloat16", "--data-parallel-size", "2"]
    for flag in ("aitraining_pl.generation.servers.auth.TokenMiddleware",
                 "aitraining_pl.generation.servers.vllm_worker.PushedWeights", "processed_logprobs"):  # fmt: skip
        assert flag in argv
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env[auth.TOKEN_FILE_ENV] == where
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o600
    token = open(where).read()
    assert auth.find_token(VLLMConfig(server_port=8123)) == token  # the trainer on this machine finds it
    with pytest.raises(ConfigError, match="--host 0.0.0.0: a server other machines can reach needs the run's token"):
        command(["--model", "m", "--host", "0.0.0.0"])
    teacher, teacher_env, _ = command(["--model", "t", "--port", "8124", "--teacher", "--dtype", "bfloat16"])
    assert "VLLM_SERVER_DEV_MODE" not in teacher_env or os.environ.get("VLLM_SERVER_DEV_MODE")
    assert "--teacher" not in teacher and "aitraining_pl.generation.servers.auth.TokenMiddleware" in teacher
    assert "dummy" not in teacher and "aitraining_pl.generation.servers.vllm_worker.PushedWeights" not in teacher


def test_a_launched_teacher_server_reads_its_own_weights_and_takes_no_pushes(tmp_path):
    """``teacher_server: {launch: ...}``'s command lines: the teacher's folder as ``--model``; vLLM without the dummy
    load and the worker extension (the token middleware kept), the HF server with ``--teacher``."""
    from aitraining_pl.generation.servers.start import hf_command, vllm_command

    vllm = vllm_command(tmp_path, "127.0.0.1", 8001, "auto", 0, VLLMConfig(), gpu=False, teacher="/models/t")
    assert vllm[vllm.index("--model") + 1] == "/models/t" and "dummy" not in vllm
    assert "aitraining_pl.generation.servers.vllm_worker.PushedWeights" not in vllm
    assert "aitraining_pl.generation.servers.auth.TokenMiddleware" in vllm
    policy = vllm_command(tmp_path, "127.0.0.1", 8001, "auto", 0, VLLMConfig(), gpu=False)
    assert policy[policy.index("--model") + 1] == str(tmp_path) and "dummy" in policy
    hf = hf_command(tmp_path, "127.0.0.1", 8001, "auto", 0, None, teacher="/models/t")
    assert hf[hf.index("--model") + 1] == "/models/t" and hf[-1] == "--teacher"
    assert "--teacher" not in hf_command(tmp_path, "127.0.0.1", 8001, "auto", 0, None)


def test_a_launched_server_gets_gpus_of_its_own(monkeypatch):
    """Issue 38, part 6: a launched server inherited ``CUDA_VISIBLE_DEVICES`` and landed on rank 0's GPU. Now its
    ``CUDA_VISIBLE_DEVICES`` is set: ``server_devices``, else the visible GPUs after the trainer's; never the
    trainer's own."""
    from aitraining_pl.errors import ConfigError
    from aitraining_pl.generation.servers.start import server_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert server_devices(None, trainer_gpus=1) == "5,6"
    assert server_devices([2], trainer_gpus=2) == "6"
    with pytest.raises(ConfigError, match="generation.server_devices: .0. are not GPUs of the server's own"):
        server_devices([0], trainer_gpus=1)
    with pytest.raises(ConfigError, match="the trainer uses all 3 GPUs visible here"):
        server_devices(None, trainer_gpus=3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if not torch.cuda.is_available():
        assert server_devices(None, trainer_gpus=0) is None  # a CPU machine: the variable is set empty


def test_vllm_serve_on_a_cpu_reserves_a_share_of_ram_that_fits(tmp_path, monkeypatch):
    """Issue 52: vLLM's default ``--gpu-memory-utilization`` 0.92 is, on a CPU, the share of RAM it reserves (it failed
    on a 24 GB machine): ``vllm-serve`` without CUDA asks 0.1 and a 1 GiB KV cache, as the launcher does, unless the
    user gives their own; with CUDA it adds neither."""
    from aitraining_pl.generation.servers import auth
    from aitraining_pl.generation.servers.start import CPU_FLAGS, vllm_command
    from aitraining_pl.generation.servers.vllm_serve import command

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv, env, _ = command(["--model", "m", "--port", "8125"], gpu=False)
    share = argv[argv.index("--gpu-memory-utilization") + 1]
    assert float(share) <= 0.25 and "--no-enable-chunked-prefill" in argv and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm_command(tmp_path, "127.0.0.1", 1, "auto", 0, VLLMConfig(), gpu=False)[-len(CPU_FLAGS) :] == list(
        CPU_FLAGS
    )  # the launcher's CPU flags are the same
    own, _, _ = command(["--model", "m", "--port", "8125", "--gpu-memory-utilization", "0.5"], gpu=False)
    assert own.count("--gpu-memory-utilization") == 1 and own[-1] == "0.5"
    on_gpu, gpu_env, _ = command(["--model", "m", "--port", "8125"], gpu=True)
    assert "--gpu-memory-utilization" not in on_gpu and "VLLM_CPU_KVCACHE_SPACE" not in gpu_env
