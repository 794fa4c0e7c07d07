"""``aitraining-pl vllm-serve``: a vLLM engine in its own process (its own GPUs or node) that samples the rollouts
of a training run in server mode (``generation.vllm.mode: server``; the client is ``vllm_backend.client``).

The engine is the colocated backend's ``VLLMEngine``, built the same way (from the model's config and tokenizer
with ``load_format="dummy"``: it holds no trained weights until the trainer pushes them) and sampling with the
same ``sampling_params`` / ``sample``, so the distribution and the end rule are those of the colocated engine.

The channel is TCP with the framing of ``vllm_backend.wire`` (JSON headers, raw tensor bytes; no pickle). Each
training process keeps one connection; requests (``op`` of the header) and answers:

- ``hello {protocol, rank}`` -> ``ready {model, version, device}``: the model's shape fields, which the client
  checks, and where the engine runs (``cuda`` or ``cpu``).
- ``channel {backend, timeout}`` -> ``channel {port}``: open a collective weight channel (``nccl`` or ``gloo``;
  ``vllm_backend.weight_group``) whose store listens on ``port`` (``--weight_port``); the server then waits up
  to ``timeout`` seconds for the trainer to join it. Sent by rank 0 when ``generation.vllm.weight_channel`` is
  not ``tcp``.
- ``load {version, via, timeout}``, then one ``weight`` frame per tensor (transformers names), then ``end
  {count}`` -> ``loaded {version, seconds}``: the weights streamed into the engine in place, one tensor at a
  time, while no rollout runs (a push that stalls for ``timeout`` seconds loses its connection). ``via: frames``:
  each frame carries its tensor; ``via: group``: each frame's ``tensor`` entry names the tensor, dtype and shape
  and the bytes come by broadcast on the connection's weight channel. Sent by rank 0.
- ``sample {version, timeout, generation, end_ids, stop_strings, skip_special_tokens, pad_token_id,
  num_samples, seed}`` with tensors ``prompt_ids``, ``prompt_mask`` (B, P; left padded) -> ``samples {batched,
  cached_tokens}`` with ``response_ids`` and ``sampled_logprobs`` (N, R): answered once the engine holds
  ``version`` (waiting up to ``timeout`` seconds for rank 0's push; then ``error``); ``batched``: how many
  requests the ``generate`` call that drew it served, ``cached_tokens``: its prompt tokens found in the prefix
  cache.
- ``bye``: the client closes.

A refused request is answered ``error {message}``. One training run per server at a time.

**Batching.** The sample requests of different connections (ranks) are merged, so vLLM's continuous batching
sees every rank's prompts at once, as with one trainer process: each request joins a queue, and a handler that
finds the engine free takes every queued request whose weights version the engine holds and serves them in one
``generate`` (``VLLMEngine.sample_many``; each answer holds that request's rows only, and a seeded request's
samples have the seeds they have alone: the same tokens, as tested on a CPU; a GPU's kernels may round a bigger
batch differently). Before taking them it waits until every open connection has a request queued, at most
``--batch_wait_ms`` (50 ms): the ranks of a step ask at about the same time (the others queued while rank 0
pushed), so the batch has them all, and a rank that does not sample this time (uneven episodes, a connection
that only pushes) costs that wait, nothing more. The engine's lock (``changed``) is held from taking the batch
to its answers, as during a weight load: a load never runs while a batch generates, and no request samples from
half-loaded weights (``engine.version`` is None during a load). A request whose version has not arrived stays
queued; if its batch fails, each of its requests is served alone, so that one request's fault (a prompt too
long) is answered to that request only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.models.generation import SampledTokens, StopRule
from aitraining_pl.models.loading import build_causal_lm, from_pretrained, load_tokenizer, one_line, resolve_dtype
from aitraining_pl.models.presets import MODEL_PRESETS
from aitraining_pl.vllm_backend.client import PROTOCOL, model_description
from aitraining_pl.vllm_backend.engine import SampleRequest, VLLMEngine, import_vllm
from aitraining_pl.vllm_backend.weight_group import BACKENDS, ChannelBroken, WeightGroup, failure, host_store
from aitraining_pl.vllm_backend.wire import FrameError, parse_entry, read_frame, send_frame


def request_timeout(request: dict[str, Any]) -> float:
    """The seconds a request allows (its ``timeout``; the client's ``server_timeout``), else the default's."""
    return float(request.get("timeout") or VLLMConfig.server_timeout)


def is_inline(model: str) -> bool:
    """Whether ``--model`` is a preset name or an inline JSON config (else a folder or a hub id)."""
    return model in MODEL_PRESETS or model.lstrip().startswith("{")


def meta_model(model: str, dtype: str | None) -> torch.nn.Module:
    """The policy's architecture on the meta device (no memory, no weights): ``model`` is a folder with a
    ``config.json``, a hub id, a preset name (``tiny-llama``) or an inline JSON config (``{"preset": ...}``)."""
    import transformers

    torch_dtype = resolve_dtype(dtype)
    if is_inline(model):
        try:
            spec = json.loads(model) if model.lstrip().startswith("{") else model
            with torch.device("meta"):
                return build_causal_lm(spec, dtype=torch_dtype)
        except ValueError as err:
            raise ConfigError(f"--model {model}", one_line(err)) from None
    config = from_pretrained(transformers.AutoConfig.from_pretrained, model, "model")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype or getattr(config, "dtype", None) or torch.float32
        )


class _Weights:
    """The ``weight`` frames of one push as ``(name, tensor)`` pairs, read as the engine consumes them: each
    frame's own tensor, or (``group``) the tensor its ``tensor`` entry describes, received by broadcast."""

    def __init__(self, sock: socket.socket, group: WeightGroup | None = None):
        self.sock, self.group, self.count, self.done = sock, group, 0, False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            header, tensors = read_frame(self.sock)
            if header["op"] == "end":
                if header.get("count") != self.count:
                    raise FrameError(f"'end' says {header.get('count')} tensors, {self.count} came")
                self.done = True
                return
            if header["op"] != "weight" or len(tensors) != (0 if self.group else 1):
                raise FrameError(f"expected one tensor per 'weight' frame, got {header['op']!r} with {len(tensors)}")
            self.count += 1
            if self.group is None:
                yield from tensors.items()
                continue
            name, dtype, shape = parse_entry(header.get("tensor"))
            try:
                tensor = self.group.receive(dtype, shape)
            except ChannelBroken as err:  # the trainer left the group: the push cannot go on
                raise ChannelBroken(f"{err} while receiving {name}") from None
            yield name, tensor


class GenerationServer(socketserver.ThreadingTCPServer):
    """A TCP server around one ``VLLMEngine`` (see the module docstring); ``serve_forever`` serves."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        engine: VLLMEngine,
        tokenizer: Any,
        model: dict[str, Any],
        host: str,
        port: int,
        weight_port: int = 0,
        batch_wait: float = 0.05,
    ):
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.weight_port = weight_port  #: where a weight channel's store listens (0: any free port)
        self.changed = threading.Condition()  #: held while the engine works; notified when weights arrive, a
        # request is queued, a batch is served or a connection closes
        self.batch_wait = batch_wait  #: seconds a batch waits for every connection to have a request queued
        self.pending: list[_Job] = []  #: sample requests not served yet (under ``changed``)
        self.gathering = False  #: a handler is gathering a batch (under ``changed``)
        self.connections = 0  #: open connections (under ``counting``)
        self.counting = threading.Lock()
        super().__init__((host, port), _Connection)

    def log(self, text: str) -> None:
        print(f"aitraining-pl vllm-serve: {text}", file=sys.stderr, flush=True)

    def open_channel(self, sock: socket.socket, request: dict[str, Any]) -> WeightGroup:
        """Answer ``channel`` with the port of a new weight channel's store, then wait for the trainer to join."""
        backend, timeout = request.get("backend"), request_timeout(request)
        if backend not in BACKENDS:
            raise ValueError(f"weight channel {backend!r}; known: {', '.join(BACKENDS)}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("the nccl weight channel needs a GPU; this server runs on the CPU (use tcp or gloo)")
        try:
            store = host_store(self.server_address[0], self.weight_port, timeout)
        except RuntimeError as err:
            raise ValueError(f"cannot listen on --weight_port {self.weight_port} ({one_line(err)})") from None
        send_frame(sock, {"op": "channel", "port": store.port})
        try:
            group = WeightGroup(backend, timeout, store=store)
        except RuntimeError as err:
            raise ConnectionError(f"the trainer did not join the {backend} weight channel ({failure(err)})") from None
        self.log(f"weight channel {backend} open (store port {store.port})")
        return group

    def load(self, sock: socket.socket, version: str, group: WeightGroup | None, timeout: float) -> dict[str, Any]:
        """Stream one push into the engine. The engine is held for the whole push, so a pusher that stalls for
        ``timeout`` seconds between two reads loses its connection (``socket.timeout``) and frees the engine."""
        weights = _Weights(sock, group)
        with self.changed:
            self.engine.version = None  # no rollout from half-loaded weights
            start = time.perf_counter()
            sock.settimeout(timeout)
            try:
                self.engine.load(weights, version)
                if not weights.done:
                    for _ in weights:  # the engine stopped early: read the rest of the push
                        pass
                    self.engine.version = None
                    raise FrameError(f"the engine took {weights.count} of the pushed tensors")
            finally:
                sock.settimeout(None)  # between requests a connection may idle
            self.changed.notify_all()
        seconds = time.perf_counter() - start
        self.log(f"loaded weights {version} ({weights.count} tensors, {seconds:.2f} s)")
        return {"op": "loaded", "version": version, "seconds": seconds}

    def sample(self, request: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """Queue the request and wait until a batch has served it (the module docstring's Batching)."""
        wanted, timeout = request.get("version"), request_timeout(request)
        skip_special = bool(request["skip_special_tokens"])
        job = _Job(
            wanted,
            SampleRequest(
                tensors["prompt_ids"],
                tensors["prompt_mask"],
                GenerationConfig(**request["generation"]),
                request["end_ids"],
                StopRule(self.tokenizer, request.get("stop_strings"), None, skip_special),
                int(request["pad_token_id"]),
                int(request["num_samples"]),
                request.get("seed"),
            ),
        )
        deadline = time.monotonic() + timeout
        with self.changed:
            self.pending.append(job)
            self.changed.notify_all()  # a gathering batch counts it
            while job.sampled is None and job.error is None:
                if self.holds(job) and not self.gathering:
                    self.serve_batch()
                    continue
                left = deadline - time.monotonic()
                if left <= 0 and not self.holds(job):
                    self.pending.remove(job)
                    held = self.engine.version or "none"
                    message = f"weights {wanted} did not arrive within {timeout:g} s (held: {held})"
                    return {"op": "error", "message": message}, {}
                self.changed.wait(left if left > 0 else None)  # held and gathering: that batch takes it
        if job.error is not None:
            raise RuntimeError(job.error)
        sampled, answer = job.sampled, {"op": "samples", "batched": job.batched, "cached_tokens": job.cached_tokens}
        return answer, {"response_ids": sampled.response_ids, "sampled_logprobs": sampled.sampled_logprobs}

    def holds(self, job: _Job) -> bool:
        """Whether the engine holds the weights ``job`` is for (not during a load)."""
        return self.engine.version is not None and job.version in (None, self.engine.version)

    def serve_batch(self) -> None:
        """With ``changed`` held: wait until every open connection has a request queued (at most
        ``batch_wait``), then serve the queued requests whose weights the engine holds in one ``generate``."""
        self.gathering = True
        try:
            self.changed.wait_for(lambda: len(self.pending) >= self.connections, self.batch_wait)
            batch = [job for job in self.pending if self.holds(job)]  # a load may have come meanwhile
            self.pending = [job for job in self.pending if job not in batch]
            self.generate(batch)
        finally:
            self.gathering = False
            self.changed.notify_all()

    def generate(self, batch: list[_Job]) -> None:
        """Serve ``batch`` in one ``generate``; if it fails, each of its requests alone (its own error)."""
        if not batch:
            return
        try:
            sampled = self.engine.sample_many([job.request for job in batch])
        except Exception as err:  # noqa: BLE001 - answered to the requests that caused it
            if len(batch) == 1:
                batch[0].error = one_line(err)
            else:
                for job in batch:
                    self.generate([job])
            return
        for job, rows, cached in zip(batch, sampled, self.engine.cached_each):
            job.sampled, job.batched, job.cached_tokens = rows, len(batch), cached


class _Job:
    """One connection's ``sample`` request, queued until a batch serves it (``GenerationServer.sample``)."""

    def __init__(self, version: Any, request: SampleRequest):
        self.version, self.request = version, request  #: the weights version it needs; ``sample``'s arguments
        self.sampled: SampledTokens | None = None  #: its rows, once served
        self.error: str | None = None  #: or why it could not be
        self.batched = self.cached_tokens = 0  #: requests in the ``generate`` that served it; its cached tokens


class _Connection(socketserver.BaseRequestHandler):
    """One training process's connection: requests served in order until ``bye`` or the connection closes."""

    server: GenerationServer
    group: WeightGroup | None = None  #: this connection's weight channel (``channel``), if it opened one

    def setup(self) -> None:
        with self.server.counting:
            self.server.connections += 1

    def finish(self) -> None:
        if self.group is not None:
            self.group.close()
        with self.server.counting:
            self.server.connections -= 1
        with self.server.changed:
            self.server.changed.notify_all()  # a gathering batch waits for one connection fewer

    def handle(self) -> None:
        sock, server = self.request, self.server
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = ":".join(map(str, self.client_address[:2]))
        while True:
            try:
                request, tensors = read_frame(sock)
            except (OSError, FrameError) as err:
                if not isinstance(err, ConnectionError) or "mid-frame" in str(err):
                    server.log(f"{peer}: {one_line(err)}; connection closed")
                return
            op = request["op"]
            try:
                if op == "bye":
                    return
                if op == "hello":
                    if request.get("protocol") != PROTOCOL:
                        raise ValueError(f"protocol {request.get('protocol')} (this server speaks {PROTOCOL})")
                    device = "cuda" if torch.cuda.is_available() else "cpu"
                    answer = {"op": "ready", "model": server.model, "version": server.engine.version, "device": device}
                    out = {}
                elif op == "channel":
                    self.group = server.open_channel(sock, request)  # answered before the trainer joins
                    continue
                elif op == "load":
                    if request.get("via") == "group" and self.group is None:
                        raise FrameError("weights pushed by the weight channel before a 'channel' request")
                    group = self.group if request.get("via") == "group" else None
                    timeout = request_timeout(request)
                    answer, out = server.load(sock, str(request.get("version")), group, timeout), {}
                elif op == "sample":
                    answer, out = server.sample(request, tensors)
                else:
                    raise ValueError(f"unknown request {op!r}")
            except (OSError, FrameError) as err:  # the connection is unusable
                server.log(f"{peer}: {op}: {one_line(err)}; connection closed")
                return
            except Exception as err:  # noqa: BLE001 - a refused request is answered, the server goes on
                server.log(f"{peer}: {op} refused: {one_line(err)}")
                answer, out = {"op": "error", "message": f"{op}: {one_line(err)}"}, {}
            try:
                send_frame(sock, answer, out)
            except OSError:
                return


def parser() -> argparse.ArgumentParser:
    defaults = VLLMConfig()
    p = argparse.ArgumentParser(
        prog="aitraining-pl vllm-serve",
        description="Serve a training run's rollouts from a vLLM engine in this process (generation.vllm.mode: "
        "server). The engine starts with the model's architecture and no trained weights; the trainer's rank 0 "
        "pushes them before each rollout whose weights changed. docs/vllm.md, Server mode.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="the policy's architecture (its weights come from the trainer): a folder with config.json and the "
        'tokenizer, a hub id, a preset (tiny-llama) or an inline JSON config ({"preset": "tiny-llama", ...})',
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, hub id or 'byte' (default: --model's folder)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=defaults.server_port, help="TCP port (0: any free one, printed)")
    p.add_argument("--weight_port", type=int, default=0,
                   help="TCP port of the weight channel's store when the trainer opens one (generation.vllm."
                   "weight_channel nccl or gloo; 0: any free one)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the config's, else float32)")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (requests with a seed use their own)")
    p.add_argument("--max_model_len", type=int, default=None, help="longest prompt + response (default: the model's)")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.9, help="share of the GPU vLLM takes (0.9)")
    p.add_argument("--tensor_parallel_size", type=int, default=1, help="GPUs the engine splits the model over")
    p.add_argument("--cpu_kv_cache_gb", type=float, default=defaults.cpu_kv_cache_gb, help="KV cache on a CPU (GiB)")
    p.add_argument(
        "--batch_wait_ms",
        type=float,
        default=50.0,
        help="how long the ranks' sample requests wait for each other, to be served in one batch "
        "(50 ms; docs/vllm.md, Batching)",
    )
    p.add_argument("--enforce_eager", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="no CUDA graphs (true: fast start; false on a GPU for speed)")  # fmt: skip
    return p


def launch(argv: list[str], log: str | os.PathLike, timeout: float = 300.0) -> tuple[subprocess.Popen, int]:
    """Start ``aitraining-pl vllm-serve ARGV`` as a child process (this interpreter, its output in the file
    ``log``) and wait until it listens: the process and its port (``--port 0`` picks a free one). A server that
    exits or is not listening after ``timeout`` seconds is a ``RuntimeError`` with the end of its log."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aitraining_pl.cli", "vllm-serve", *argv], env=env, stdout=sink, stderr=sink
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log, errors="replace") as source:
            found = re.search(r"vllm-serve: listening on \S+:(\d+) ", source.read())
        if found:
            return proc, int(found.group(1))
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    with open(log, errors="replace") as source:
        raise RuntimeError(f"vllm-serve did not start (exit status {proc.wait()}):\n{source.read()[-3000:]}")


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> None:
    """Build the engine and serve until interrupted (``aitraining-pl vllm-serve --help``)."""
    args = parser().parse_args(argv)
    import_vllm()  # one line naming the extra when vLLM is missing
    tokenizer_name = args.tokenizer or (None if is_inline(args.model) else args.model)
    if tokenizer_name is None:
        raise ConfigError("--tokenizer", f"needed with --model {args.model} (default: the model folder's or hub id's)")
    policy = meta_model(args.model, None if args.dtype == "auto" else args.dtype)
    tokenizer = load_tokenizer(tokenizer_name)
    options = VLLMConfig(
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
    )
    engine = VLLMEngine(policy, tokenizer, options, seed=args.seed)
    description = model_description(policy.config)
    try:
        batch_wait = args.batch_wait_ms / 1000
        server = GenerationServer(engine, tokenizer, description, args.host, args.port, args.weight_port, batch_wait)
    except OSError as err:
        engine.close()
        where = f"--host {args.host} --port {args.port}"
        raise ConfigError(where, f"cannot listen there ({err.strerror or err})") from None
    host, port = server.server_address[:2]
    kind = f"{description['model_type']}, {args.dtype}"
    server.log(f"listening on {host}:{port} ({kind}; waiting for the trainer's weights)")
    signal.signal(signal.SIGTERM, _interrupt)  # ``kill``: shut the engine down and delete its folder
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
