"""The generation server's guards (``aitraining_pl/generation/servers/tcp_guards.py``, ``server.py``), each probed as a
stranger or a careless run would: the token at ``hello``, the run that owns the server, pushes checked before
anything is loaded, the server's own timeouts, caps on declared sizes and connections, idle clients dropped, the
accept loop at rest when out of file descriptors, the engine's folder removed when it fails to build, and the
client's and ``vllm-serve``'s refusals. A ``GenerationServer`` around a recording stand-in engine, served from a
thread: no vLLM needed (the real engine's checks are in ``tests/vllm_backend/test_vllm_server.py``)."""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import struct
import threading

import pytest
import torch
from server_fixtures import SPEC, RecordingEngine, options, serving

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.servers import tcp_wire as wire
from aitraining_pl.generation.servers.tcp_wire import read_frame, send_frame
from aitraining_pl.models import build_causal_lm

TOKEN = "test-token"  #: ``serving``'s


@pytest.fixture(scope="module")
def model():
    return build_causal_lm(SPEC, seed=3)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


class Raw:
    """A connection driven frame by frame: a stranger, or a rank of a run that speaks the protocol by hand."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def call(self, header, tensors=None) -> dict:
        send_frame(self.sock, header, tensors)
        return read_frame(self.sock)[0]

    def hello(self, token: str = TOKEN, run: str = "raw", rank: int = 0) -> dict:
        challenge = self.call({"op": "hello", "protocol": wire.PROTOCOL, "rank": rank, "run": run})
        if challenge["op"] != "challenge":
            return challenge
        return self.call({"op": "auth", "proof": wire.proof(token, challenge["nonce"], run, rank)})

    def push(self, version, tensors: dict[str, torch.Tensor], **extra) -> dict:
        send_frame(self.sock, {"op": "load", "version": version, "via": "frames", **extra})
        for name, tensor in tensors.items():
            send_frame(self.sock, {"op": "weight"}, {name: tensor})
        return self.call({"op": "end", "count": len(tensors)})

    def closed(self) -> bool:
        """Whether the server closed the connection (after any last frames it sent)."""
        try:
            while True:
                read_frame(self.sock)
        except ConnectionError:
            return True

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------- the token
def test_a_stranger_without_the_token_reads_nothing_and_pushes_nothing(model, capfd):
    """Before: ``hello`` answered ``ready`` with the run's current version to anyone, and a push under it was
    loaded. Now ``hello`` is answered by a challenge; a wrong proof, or any request before the proof, is refused
    with one line and the connection closed; the engine keeps the owner's weights. The token is in no message."""
    engine = RecordingEngine()
    with serving(engine, model) as port:
        stranger = Raw(port)
        answer = stranger.call({"op": "hello", "protocol": wire.PROTOCOL, "rank": 0, "run": "stranger"})
        assert answer["op"] == "challenge" and "version" not in answer and "model" not in answer, answer
        answer = stranger.call({"op": "auth", "proof": wire.proof("guessed", answer["nonce"], "stranger", 0)})
        assert answer == {"op": "error", "message": "hello: the token does not match this server's (docs/vllm.md, "
                          "Server mode)"}  # fmt: skip
        assert stranger.closed()
        pusher = Raw(port)
        answer = pusher.call({"op": "load", "version": "stranger:1", "via": "frames"})
        assert answer == {"op": "error", "message": "a connection starts with 'hello', not 'load'"}, answer
        assert pusher.closed()
        assert engine.pushes == [] and engine.version is None
    assert TOKEN not in capfd.readouterr().err


def test_the_client_names_where_its_token_came_from_never_the_token(model, tmp_path, monkeypatch):
    """A client whose token differs from the server's: one line naming the token's source, not the token."""
    from aitraining_pl.generation.servers.client import VLLMServerClient

    wrong = tmp_path / "token"
    wrong.write_text("not-the-servers\n")
    with serving(RecordingEngine(), model) as port:
        with pytest.raises(GenerationServerError) as caught:
            VLLMServerClient(model, options(port, server_token_file=str(wrong)))
        message = str(caught.value)
        assert f"it refused the token from generation.vllm.server_token_file {wrong}" in message, message
        assert "not-the-servers" not in message and "\n" not in message
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "elsewhere"))  # no token file where the client looks
        with pytest.raises(ConfigError, match="generation.vllm.server_token_file: no token for the generation server"):
            VLLMServerClient(model, options(port))
        monkeypatch.setenv(wire.TOKEN_ENV, TOKEN)  # the environment variable comes before the loopback file
        VLLMServerClient(model, options(port)).close()


def test_vllm_serve_refuses_a_bind_other_machines_reach_without_a_token(monkeypatch, tmp_path):
    """Before the engine is built: ``--host 0.0.0.0`` with no token is one ``ConfigError`` line; on loopback a
    token is generated and written owner-only (0600 in a 0700 folder) to the file named by the port."""
    from aitraining_pl.generation.servers.serve import main
    from aitraining_pl.generation.servers.tcp_guards import server_token, write_token

    monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="--host 0.0.0.0: a server other machines can reach needs a token"):
        main(["--model", "tiny-llama", "--tokenizer", "byte", "--host", "0.0.0.0"])
    token, generated = server_token("127.0.0.1", None)
    assert generated and len(token) >= 32 and token != server_token("127.0.0.1", None)[0]
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = write_token(token, 8123)
    assert path == wire.token_path(8123) and path.read_text() == token
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv(wire.TOKEN_ENV, "given")
    assert server_token("0.0.0.0", None) == ("given", False)


# ---------------------------------------------------------------------- the owner and its versions
def test_another_run_is_refused_at_hello_and_the_owner_goes_on(model):
    """Before: a second run (with the token) could push under the first run's feet. Now the first run owns the
    server while it has a connection open: another run's hello is one line; the owner pushes on; once the owner
    has closed, the next run (a resumed one) owns it."""
    from aitraining_pl.generation.servers.client import VLLMServerClient

    engine = RecordingEngine()
    with serving(engine, model) as port:
        owner = VLLMServerClient(model, options(port), run="first")
        try:
            with pytest.raises(GenerationServerError, match="this server serves another run .1 connections open.; one "
                               "training run per server") as refused:  # fmt: skip
                VLLMServerClient(model, options(port), run="second")
            assert "first" not in str(refused.value)  # issue 40, probe 6: the owner's run id was printed
            assert owner.sync(model, version=1) and engine.version == "first:1"
        finally:
            owner.close()
        resumed = VLLMServerClient(model, options(port), run="resumed")
        try:
            assert resumed.sync(model, version=1) and engine.version == "resumed:1"
        finally:
            resumed.close()


def test_a_token_holder_never_learns_the_owners_run(model):
    """Issue 40, probe 6: a refusal printed the owner's run id and ``ready`` carried its weights version
    (``run:step``), so a token holder could reconnect as that run and push zero weights. Now neither says the run:
    a scorer (which any token holder may be) sees the step only."""
    engine = RecordingEngine()
    with serving(engine, model) as port:
        owner = Raw(port)
        assert owner.hello(run="secret-run")["op"] == "ready"
        assert owner.push("secret-run:3", weights(model))["op"] == "loaded"
        stranger = Raw(port)
        challenge = stranger.call({"op": "hello", "protocol": wire.PROTOCOL, "rank": 0, "run": "x", "role": "scorer"})
        ready = stranger.call({"op": "auth", "proof": wire.proof(TOKEN, challenge["nonce"], "x", 0)})
        assert ready["op"] == "ready" and "secret-run" not in json.dumps(ready) and ready["version"] == 3
        trainer = Raw(port)
        refused = trainer.hello(run="other")
        assert refused["op"] == "error" and "secret-run" not in json.dumps(refused)
        for connection in (owner, stranger, trainer):
            connection.close()


@pytest.mark.parametrize(
    "version, why",
    [
        ("raw:1", "raw:1 is not newer than the last push (raw:2)"),
        ("raw:2", "raw:2 is not newer than the last push (raw:2)"),
        ("", "'' is not one of this run's (raw:<step>)"),
        (None, "None is not one of this run's (raw:<step>)"),
        ("other:9", "'other:9' is not one of this run's (raw:<step>)"),
    ],
)
def test_versions_only_move_forward_and_a_refused_one_does_not_stall_the_owner(model, version, why):
    """Before: an older, empty or foreign version was loaded, and the run's ranks waited for theirs until their
    timeout. Now it is answered with one line at once; the engine keeps the owner's version, whose samples are
    served; the next newer push goes through."""
    engine = RecordingEngine()
    with serving(engine, model) as port:
        owner = Raw(port)
        assert owner.hello()["op"] == "ready"
        assert owner.push("raw:2", weights(model))["op"] == "loaded"
        answer = owner.push(version, weights(model))
        assert answer == {"op": "error", "message": f"load: weights version {why}"}, answer
        assert engine.version == "raw:2" and len(engine.pushes) == 1
        assert owner.push("raw:3", weights(model))["op"] == "loaded" and engine.version == "raw:3"


# ---------------------------------------------------------------------- pushes checked before they are loaded
def _broken(model, how: str) -> dict[str, torch.Tensor]:
    tensors = weights(model)
    name = "model.layers.0.mlp.up_proj.weight"
    if how == "nan":
        tensors[name][0, 0] = math.nan
    elif how == "inf":
        tensors[name][1, 2] = -math.inf
    elif how == "int64":
        tensors[name] = tensors[name].long()
    elif how == "shape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    elif how == "unknown":
        tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    elif how == "missing":
        del tensors[name]
    return tensors


@pytest.mark.parametrize(
    "how, message",
    [
        ("nan", "'model.layers.0.mlp.up_proj.weight' has 1 non-finite values (NaN or inf)"),
        ("inf", "'model.layers.0.mlp.up_proj.weight' has 1 non-finite values (NaN or inf)"),
        ("int64", "'model.layers.0.mlp.up_proj.weight' is int64, the served model's is float32"),
        ("shape", "'model.layers.0.mlp.up_proj.weight' has shape [128, 63], the served model's is [128, 64]"),
        ("unknown", "'model.layers.9.extra.weight' is not a tensor of the served model"),
        ("missing", "the push lacks 1 of the served model's tensors ('model.layers.0.mlp.up_proj.weight')"),
    ],
)
def test_a_push_is_checked_before_anything_is_loaded(model, how, message):
    """Before: NaN and int64 tensors were loaded (vLLM then sampled NaN log-probs even after a correct push),
    and a wrong shape broke the engine's next load. Now the push is read to its end, answered with one line, and
    the engine keeps its weights and version; the next correct push loads."""
    engine = RecordingEngine()
    with serving(engine, model) as port:
        owner = Raw(port)
        assert owner.hello()["op"] == "ready"
        assert owner.push("raw:1", weights(model))["op"] == "loaded"
        answer = owner.push("raw:2", _broken(model, how))
        assert answer == {"op": "error", "message": f"load: {message}"}, answer
        assert engine.version == "raw:1" and len(engine.pushes) == 1
        assert owner.push("raw:3", weights(model))["op"] == "loaded" and engine.version == "raw:3"
        for name, tensor in model.state_dict().items():
            assert torch.equal(engine.pushes[-1][name], tensor), name


def test_a_declared_size_beyond_the_model_is_refused_unread(model):
    """Before: two ~100-byte headers declaring 512 MiB each grew the server by 0.6-0.8 GB before any payload.
    Now a stranger's header with tensors is refused before its payload (nothing is allocated for it; the
    framing reads in chunks anyway, ``test_wire.py``), and the owner's push may declare no tensor larger than
    the model's largest."""
    with serving(RecordingEngine(), model) as port:
        stranger = Raw(port)
        send_frame(stranger.sock, {"op": "hello", "protocol": wire.PROTOCOL, "rank": 0, "run": "x"})
        stranger.sock.sendall(_declaring(128 << 20))  # as its proof
        assert stranger.closed()
        stranger = Raw(port)
        stranger.sock.sendall(_declaring(128 << 20))
        assert stranger.closed()
        owner = Raw(port)
        assert owner.hello()["op"] == "ready"
        send_frame(owner.sock, {"op": "load", "version": "raw:1", "via": "frames"})
        owner.sock.sendall(_declaring(128 << 20))
        assert owner.closed()


def _declaring(numel: int) -> bytes:
    """A ``weight`` frame's header declaring ``numel`` float32 values (none of them sent)."""
    entry = {"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [numel]}
    header = json.dumps({"op": "weight", "tensors": [entry]}).encode()
    return wire.MAGIC + struct.pack(">I", len(header)) + header


def test_a_sample_request_over_the_cap_or_with_other_tensors_is_refused_unread(model):
    """A ``sample`` request may declare its two int64 prompt tensors only, within ``max_request_bytes``: a
    request declaring more, or other tensors, closes the connection before its payload is read."""
    from aitraining_pl.generation.servers.tcp_guards import Limits

    entries = [{"name": name, "dtype": "int64", "shape": [1024, 1024]} for name in ("prompt_ids", "prompt_mask")]
    with serving(RecordingEngine(), model, limits=Limits(max_request_bytes=1 << 20)) as port:
        for tensors in (entries, [{**entries[0], "shape": [1, 4]}, {**entries[1], "dtype": "float32"}]):
            owner = Raw(port)
            assert owner.hello()["op"] == "ready"
            header = json.dumps({"op": "sample", "tensors": tensors}).encode()
            owner.sock.sendall(wire.MAGIC + struct.pack(">I", len(header)) + header)
            assert owner.closed()


# ---------------------------------------------------------------------- the server's own timeouts
@pytest.mark.parametrize("asked", [-1.0, math.nan, 1e6])
def test_a_push_that_stalls_holds_nothing_and_its_timeout_is_the_servers(model, asked):
    """Before: a ``load`` frame's own timeout (chosen by its sender: -1, NaN, 1e6) held the engine, and -1
    failed after ``engine.version`` was cleared (every rollout then waited). Now a push is staged before the
    engine is taken, so a stalled one holds nothing (another push of the run loads meanwhile), and it is dropped
    after the server's ``timeout`` (here 0.5 s), whatever it asked for."""
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.generation.servers.tcp_guards import Limits

    engine = RecordingEngine()
    with serving(engine, model, limits=Limits(timeout=0.5)) as port:
        client = VLLMServerClient(model, options(port, server_timeout=20), run="raw")
        stalled = Raw(port)
        try:
            assert stalled.hello(rank=1)["op"] == "ready"
            send_frame(stalled.sock, {"op": "load", "version": "raw:5", "via": "frames", "timeout": asked})
            send_frame(stalled.sock, {"op": "weight"}, {"model.embed_tokens.weight": weights(model)[
                "model.embed_tokens.weight"]})  # fmt: skip
            assert client.sync(model, version=1) and engine.version == "raw:1"
            assert stalled.closed()  # dropped after the server's 0.5 s
        finally:
            client.close()


# ---------------------------------------------------------------------- connections
def test_connections_are_capped_and_idle_ones_dropped(model):
    """Before: connections were accepted up to the file limit (256), locking new ranks out, and a silent one was
    kept forever. Now past ``max_connections`` a connection gets one line and is closed; a connection that does
    not prove the token within ``handshake_timeout``, or idles past ``idle_timeout`` once it has, is dropped
    (the latter with a last line), which frees its place."""
    from aitraining_pl.generation.servers.tcp_guards import Limits

    limits = Limits(max_connections=2, idle_timeout=0.5, handshake_timeout=0.5)
    with serving(RecordingEngine(), model, limits=limits) as port:
        owner, silent = Raw(port), Raw(port)
        assert owner.hello()["op"] == "ready"
        excess = Raw(port)
        assert read_frame(excess.sock)[0] == {
            "op": "error",
            "message": "the server has 2 connections open (--max_connections); refused",
        }
        assert silent.closed()  # no hello within the handshake timeout
        assert read_frame(owner.sock)[0] == {
            "op": "error",
            "message": "idle for 0.5 s (--idle_timeout); connection closed",
        }
        assert owner.closed()
        assert Raw(port).hello()["op"] == "ready"  # the places are free again


class _OutOfDescriptors:
    """Stands in for the listening socket: ``accept`` fails as with no file descriptor left (counted)."""

    def __init__(self, real: socket.socket):
        self.real, self.calls, self.called = real, 0, threading.Event()

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self):
        self.calls += 1
        self.called.set()
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def test_the_accept_loop_rests_when_out_of_file_descriptors(model):
    """Before: with no descriptor left, ``accept`` failed at once on a listening socket that stayed readable, and
    the loop spun (68% of a core). Now it rests ``accept_backoff`` seconds, or until a connection closes: in a
    half-second window with a connection waiting, ``accept`` is tried once, not thousands of times."""
    from aitraining_pl.generation.servers.tcp_server import GenerationServer

    server = GenerationServer(RecordingEngine(), None, model, "127.0.0.1", 0, TOKEN)
    server.accept_backoff = 60.0
    listening, server.socket = server.socket, _OutOfDescriptors(server.socket)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    waiting = socket.create_connection(listening.getsockname())
    try:
        assert server.socket.called.wait(30)
        threading.Event().wait(0.5)  # a window to count retries in (nothing is ordered by it)
        assert server.socket.calls == 1, f"accept tried {server.socket.calls} times"
    finally:
        waiting.close()
        server.freed.set()  # end the rest
        server.shutdown()
        server.socket = listening
        server.server_close()


# ---------------------------------------------------------------------- the engine's folder, the client's port
def test_the_engine_folder_is_removed_when_the_engine_fails_to_build(model, monkeypatch, tmp_path):
    """Before: ``VLLMEngine.__init__`` left its temporary folder (config, tokenizer) behind when vLLM failed."""
    import tempfile
    import types

    from aitraining_pl.generation import vllm as engine_module
    from aitraining_pl.generation.config import VLLMConfig

    def fail(**kwargs):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(engine_module, "import_vllm", lambda: types.SimpleNamespace(LLM=fail))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # what the engine would set on a CPU
    with pytest.raises(RuntimeError, match="no engine today"):
        engine_module.VLLMEngine(model, None, VLLMConfig(cpu_kv_cache_gb=1))
    assert list(tmp_path.iterdir()) == []


def test_the_client_refuses_port_0():
    """Before: ``server_port: 0`` was accepted and the client tried to connect until its timeout."""
    from aitraining_pl.generation.config import VLLMConfig
    from aitraining_pl.generation.servers.client import VLLMServerClient

    with pytest.raises(ConfigError, match=r"generation.vllm.server_port: must be the server's port, 1 to 65535, got "
                       "0 .vllm-serve --port 0 picks a free port"):  # fmt: skip
        VLLMServerClient(build_causal_lm(SPEC), VLLMConfig(mode="server", server_port=0, server_timeout=1))


def test_vllm_serve_defaults_are_the_configs():
    """``vllm-serve``'s defaults are ``VLLMConfig``'s (and the limits' ``Limits``'s), but the GPU share: 0.9, the
    GPU being the server's alone (the config's 0.3 leaves room for training beside a colocated engine)."""
    from aitraining_pl.generation.config import VLLMConfig
    from aitraining_pl.generation.servers.serve import SERVER_GPU_MEMORY, parser
    from aitraining_pl.generation.servers.tcp_guards import Limits

    args, config, limits = parser().parse_args(["--model", "tiny-llama"]), VLLMConfig(), Limits()
    same = {
        "host": config.server_host,
        "port": config.server_port,
        "max_model_len": config.max_model_len,
        "tensor_parallel_size": config.tensor_parallel_size,
        "cpu_kv_cache_gb": config.cpu_kv_cache_gb,
        "enforce_eager": config.enforce_eager,
        "timeout": config.server_timeout,
        "idle_timeout": limits.idle_timeout,
        "max_connections": limits.max_connections,
    }
    assert {name: getattr(args, name) for name in same} == same
    assert args.gpu_memory_utilization == SERVER_GPU_MEMORY == 0.9 and limits.timeout == config.server_timeout
    for text, value in (("auto", "auto"), ("false", False), ("True", True)):
        assert parser().parse_args(["--model", "m", "--enforce_eager", text]).enforce_eager == value


def test_the_weight_channel_is_chosen_at_the_first_push_not_at_setup(model, monkeypatch):
    """Issue 38: the channel was chosen from the policy's device when the client was built (the module's ``setup``,
    before Lightning moves the policy to its GPU), so ``auto`` could never pick NCCL. Now it is chosen at the first
    push, from the device of the first tensor pushed."""
    from aitraining_pl.generation.servers import client as client_module

    seen = []
    chosen = client_module.weight_channel
    monkeypatch.setattr(client_module, "weight_channel", lambda name, where, server: seen.append(where) or chosen(
        name, where, server))  # fmt: skip
    engine = RecordingEngine()
    with serving(engine, model) as port:
        client = client_module.VLLMServerClient(model, options(port))
        try:
            assert seen == []  # nothing decided at setup
            assert client.sync(model, version=1) and seen == ["cpu"]
            assert client.sync(model, version=2) and seen == ["cpu"]  # once
        finally:
            client.close()
