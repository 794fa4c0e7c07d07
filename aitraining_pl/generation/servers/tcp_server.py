"""The generation server of ``aitraining-pl serve`` (``vllm-serve``; the command: ``servers.serve``): an engine
in its own process (its own GPUs or node) that samples the rollouts of a training run in server mode
(``generation.vllm.mode: server``; the client is ``generation.servers.client``).

The engine (``--engine``) is the colocated backend's ``VLLMEngine`` (``vllm``, the default), built the same way
(from the model's config and tokenizer with ``load_format="dummy"``: it holds no trained weights until the
trainer pushes them) and sampling with the same ``sampling_params`` / ``sample``, so the distribution and the end
rule are those of the colocated engine; or ``hf_engine.HFServerEngine`` (``hf``: this project's KV-cache decoder,
no vLLM needed). The server uses only ``load``, ``sample_many``, ``cached_each``, ``version``,
``prompt_logprobs`` and ``close`` of it (and ``stage`` where ``in_flight`` is true).

The channel is TCP with the framing of ``generation.servers.tcp_wire`` (JSON headers, raw tensor bytes; no pickle). Each
training process keeps one connection; requests (``op`` of the header) and answers:

- ``hello {protocol, rank, run, role}`` -> ``challenge {nonce}``, then ``auth {proof}`` -> ``ready {model, version,
  device, fixed, engine}``: the connection proves the server's token (``wire.proof``, an HMAC of the nonce; the
  token never travels), and a ``trainer``'s run must own the server (``guards.Ownership``; a ``scorer``, a served
  teacher's client, joins no run: it never owns the server nor locks a run out, and sends ``logprobs`` and ``bye``
  only; a ``pusher``, a trainer's second connection that pushes while its first waits for an answer, joins its run
  and sends ``load`` and ``bye`` only); then the model's shape fields, which the client checks, where the engine
  runs (``cuda`` or ``cpu``) and which engine it is (``vLLM``, ``HF``: messages name the server by it). Nothing
  else is answered before ``ready``.
- ``channel {backend}`` -> ``channel {port}``: open a collective weight channel (``nccl`` or ``gloo``;
  ``generation.servers.weights``) whose store listens on ``port`` (``--weight_port``); the server then waits up
  to its ``--timeout`` for the trainer to join it. Sent by rank 0 when ``generation.vllm.weight_channel`` is
  not ``tcp``.
- ``load {version, via, in_flight}``, then one ``weight`` frame per tensor of the model (transformers names), then
  ``end {count}`` -> ``loaded {version, seconds, in_flight}``: the push is checked tensor by tensor against the
  served model (``guards.WeightSpecs``: names, shapes and dtypes before the bytes are read, then finiteness) and
  staged in host memory; only a push that passed is loaded into the engine, in place, while no rollout runs and
  once the other ranks no longer need the held weights (``batching``, the load gate). A refused push is read to
  its end and answered ``error``, the engine keeping its weights. ``version`` is ``run:step`` with a step above
  the run's last push. ``via: frames``: each frame carries its tensor; ``via: group``: each frame's ``tensor``
  entry names the tensor, dtype and shape and the bytes come by broadcast on the connection's weight channel. A
  push silent for ``--timeout`` seconds loses its connection. ``in_flight: true`` to an engine that allows it (the
  HF engine): the weights are handed to the engine at once and a running batch continues with them from its next
  decode step (AReaL's and PipelineRL's partial rollouts; ``hf_engine``); else the flag is ignored. vLLM's
  in-flight path is not built: it needs vLLM's ``AsyncLLM`` (``pause_generation`` / ``resume_generation``) in
  place of the in-process ``LLM`` the engine runs, and could not be tested on vLLM's CPU build here.
- ``sample {version, newer, timeout, generation, end_ids, stop_strings, skip_special_tokens, pad_token_id,
  num_samples, seed}`` with tensors ``prompt_ids``, ``prompt_mask`` (B, P; left padded) -> ``samples {batched,
  cached_tokens, version}`` with ``response_ids``, ``sampling_logprobs`` (N, R) and ``token_versions`` (N, R;
  the step of the weights that sampled each token): answered once the engine holds ``version`` (with ``newer``:
  that version or a later one of the run), waiting up to ``timeout`` seconds, at most ``--timeout``, for rank 0's
  push (then ``error``); ``batched``: how many requests the ``generate`` call that drew it served,
  ``cached_tokens``: its prompt tokens found in the prefix cache, ``version``: the weights held when it started.
- ``logprobs {start, temperature}`` with tensors ``input_ids``, ``attention_mask`` (N, L; left padded as the
  rollouts', int64, within the request cap) -> ``logprobs {version}`` with ``logprobs`` (N, L - start) float32: the
  log-probs of the given tokens from column ``start`` on under the untruncated softmax of the held weights
  (``VLLMEngine.prompt_logprobs``; never re-tokenised), 0 on the padding; only ``temperature`` 1 (vLLM's prompt
  log-probs are of the raw logits). A served teacher's scores (``client.ServedTeacher``): a server started with
  ``--teacher`` holds the teacher's own weights (``fixed``) and refuses every push.
- ``bye`` -> ``bye``: the client closes (its run frees the server once its last connection has said it).

A refused request is answered ``error {message}``. One training run per server at a time. The limits (the
server's own timeouts, idle and unauthenticated connections dropped, at most ``--max_connections``) are
``guards.Limits``; docs/vllm.md, Server mode, has the security model.

**Batching** (``batching.SampleQueue``). The sample requests of different connections (ranks) are merged, so vLLM's
continuous batching sees every rank's prompts at once, as with one trainer process: each request joins a queue,
and a handler that finds the engine free takes every queued request the held weights may serve and serves them in
one ``generate`` (``sample_many``; each answer holds that request's rows only, and a seeded request's samples have
the seeds they have alone: the same tokens, as tested on a CPU; a GPU's kernels may round a bigger batch
differently). Before taking them it waits until every open trainer connection has a request queued, at most
``--batch_wait_ms`` (50 ms): the ranks of a step ask at about the same time (the others queued while rank 0
pushed), so the batch has them all, and a rank that does not sample this time costs that wait, nothing more. The
server's lock (``changed``) is held from taking the batch to its answers, as during a weight load: a load never
runs while a batch generates (an in-flight push excepted, which the engine's own lock makes atomic), and no
request samples from half-loaded weights (``engine.version`` is None during a load). A request whose version has
not arrived stays queued; if its batch fails, each of its requests is served alone, so that one request's fault
(a prompt too long) is answered to that request only.
"""

from __future__ import annotations

import errno
import hmac
import secrets
import socket
import socketserver
import sys
import threading
import time
from typing import Any

import torch

from aitraining_pl.generation.backend import SampleRequest, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.tcp_batching import Job, SampleQueue, Seat
from aitraining_pl.generation.servers.tcp_guards import (
    HANDSHAKE_HEADER,
    Limits,
    Ownership,
    Push,
    PushRefused,
    WeightSpecs,
    no_tensors,
)
from aitraining_pl.generation.servers.tcp_wire import (
    PROTOCOL,
    SAMPLED,
    Entry,
    FrameError,
    model_description,
    nbytes,
    proof,
    read_frame,
    send_frame,
)
from aitraining_pl.generation.servers.weights import BACKENDS, WeightGroup, failure, host_store
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.loading import one_line

PROMPTS = ("prompt_ids", "prompt_mask")  #: the tensors of a ``sample`` request
SCORED = ("input_ids", "attention_mask")  #: the tensors of a ``logprobs`` request
#: who says ``hello``: a training run's process, its second connection that only pushes weights (while its first
#: waits for an answer), or a served teacher's client
ROLES = ("trainer", "pusher", "scorer")


class GenerationServer(socketserver.ThreadingTCPServer):
    """A TCP server around one engine, a ``VLLMEngine`` or an ``HFServerEngine`` (see the module docstring);
    ``serve_forever`` serves. ``name``: the command, as the log lines start with it."""

    daemon_threads = True
    allow_reuse_address = True
    accept_backoff = 1.0  #: seconds the accept loop rests when the process is out of file descriptors

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        model: torch.nn.Module,
        host: str,
        port: int,
        token: str,
        weight_port: int = 0,
        batch_wait: float = 0.05,
        limits: Limits | None = None,
        fixed: bool = False,
        name: str = "vllm-serve",
    ):
        self.engine, self.tokenizer, self.token, self.name = engine, tokenizer, token, name
        self.fixed = fixed  #: the engine holds fixed weights (a teacher, ``vllm-serve --teacher``): no pushes
        self.model = model_description(model.config)  #: what ``ready`` answers (the client compares it)
        self.specs = WeightSpecs(model)  #: what a push must carry
        self.limits = limits or Limits()
        self.ownership = Ownership()
        self.weight_port = weight_port  #: where a weight channel's store listens (0: any free port)
        self.changed = threading.Condition()  #: held while the engine works; notified when weights arrive, a
        # request is queued, a batch is served or a connection closes
        self.pushing = threading.Lock()  #: held from a push's acceptance to its load (loads keep their order)
        self.queue = SampleQueue(engine, self.ownership, self.changed, batch_wait, self.limits.timeout, self.log)
        self.connections = 0  #: open connections, authenticated or not (under ``counting``)
        self.counting = threading.Lock()
        self.freed = threading.Event()  #: set when a connection closes (the accept loop's rest ends)
        super().__init__((host, port), _Connection)

    def log(self, text: str) -> None:
        print(f"aitraining-pl {self.name}: {text}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ connections
    def get_request(self) -> tuple[socket.socket, Any]:
        """``accept``; out of file descriptors, rest ``accept_backoff`` seconds (or until a connection closes)
        before the loop tries again, instead of spinning on a listening socket that stays readable."""
        try:
            return super().get_request()
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                self.log(f"out of file descriptors ({err.strerror}); new connections wait")
                self.freed.clear()
                self.freed.wait(self.accept_backoff)
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Count the connection; past ``max_connections`` refuse it with an ``error`` frame."""
        with self.counting:
            full = self.connections >= self.limits.max_connections
            if not full:
                self.connections += 1
        if full:
            message = f"the server has {self.limits.max_connections} connections open (--max_connections); refused"
            self.log(f"{client_address[0]}:{client_address[1]}: {message}")
            try:
                request.settimeout(1.0)
                send_frame(request, {"op": "error", "message": message})
            except OSError:
                pass
        return not full

    def closed(self) -> None:
        """A connection closed: one fewer open, and a gathering batch waits for one fewer."""
        with self.counting:
            self.connections -= 1
        self.freed.set()
        with self.changed:
            self.changed.notify_all()

    # ------------------------------------------------------------------ requests
    def open_channel(self, sock: socket.socket, request: dict[str, Any]) -> WeightGroup:
        """Answer ``channel`` with the port of a new weight channel's store, then wait for the trainer to join."""
        backend, timeout = request.get("backend"), self.limits.timeout
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

    def load(
        self, sock: socket.socket, seat: Seat, version: Any, group: WeightGroup | None, in_flight: bool = False
    ) -> dict[str, Any]:
        """Receive one push of ``seat``'s run (``Push``: checked and staged, with ``--timeout`` between two frames),
        then load it into the engine while no rollout runs, once the other ranks have moved on (the load gate,
        ``batching``); ``in_flight`` to an engine that allows it (``HFServerEngine.stage``): hand it over at once,
        the running batch taking it between two decode steps. A refused push raises ``PushRefused`` before the
        engine is touched; only a failure of the engine's own load leaves it without a version (nothing is
        sampled from half-loaded weights)."""
        start, run = time.perf_counter(), seat.run
        push, step = Push(sock, self.specs, group), -1
        try:
            if self.fixed:
                raise PushRefused("this server serves a teacher's fixed weights (vllm-serve --teacher): no pushes")
            step = self.ownership.step_of(run, version)
        except PushRefused as err:
            push.refused = err  # the push is still read to its end
        sock.settimeout(self.limits.timeout)
        staged = push.receive()
        in_flight = in_flight and getattr(self.engine, "in_flight", False)
        with self.pushing:
            if in_flight:  # the engine's own lock makes the swap atomic; waiters are told without waiting
                self.ownership.accept(run, step)
                self.engine.stage(staged, version)
                self.queue.wake()
            else:
                with self.changed:
                    self.queue.wait_for_ranks(run, seat.rank)
                    self.ownership.accept(run, step)
                    self.engine.version = None  # no rollout from half-loaded weights, should the load fail
                    self.engine.load(staged, version)
                    self.changed.notify_all()
        seconds = time.perf_counter() - start
        how = "staged in flight" if in_flight else "loaded"
        self.log(f"{how} weights {version} ({push.count} tensors, {seconds:.2f} s)")
        return {"op": "loaded", "version": version, "seconds": seconds, "in_flight": in_flight}

    def sample(self, request: dict[str, Any], tensors: dict[str, torch.Tensor], seat: Seat | None) -> tuple[dict, dict]:
        """Queue the request and wait until a batch has served it (``batching.SampleQueue``)."""
        timeout, skip_special = self.limits.bound(request.get("timeout")), bool(request["skip_special_tokens"])
        job = Job(
            request.get("version"),
            bool(request.get("newer", False)),
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
        refused = self.queue.serve(job, timeout, seat)
        if refused is not None:
            return {"op": "error", "message": refused}, {}
        if job.error is not None:
            raise RuntimeError(job.error)
        sampled = job.sampled
        answer = {"op": "samples", "batched": job.batched, "cached_tokens": job.cached_tokens}
        rows = sampled.response_ids, sampled.sampling_logprobs.float(), sampled.token_versions.long()
        served_by = None if job.served_by is None else str(job.served_by)
        return {**answer, "version": served_by}, dict(zip(SAMPLED, rows))

    def logprobs(self, request: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """The log-probs of given tokens under the weights the engine holds (``VLLMEngine.prompt_logprobs``; a served
        teacher's scores), computed while no rollout or load runs."""
        ids, mask, start = tensors["input_ids"], tensors["attention_mask"], request.get("start")
        temperature = request.get("temperature", 1.0)
        if ids.dim() != 2 or ids.shape != mask.shape:
            raise ValueError(f"input_ids {list(ids.shape)} and attention_mask {list(mask.shape)}: two equal (N, L)")
        if type(start) is not int or not 1 <= start <= ids.shape[1]:
            raise ValueError(f"start {start!r} is not a column of the {ids.shape[1]} tokens (1 to {ids.shape[1]})")
        if not isinstance(temperature, (int, float)) or float(temperature) != 1.0:
            raise ValueError(
                f"temperature {temperature!r}: vLLM's prompt log-probs are of the raw logits (temperature 1), from "
                "which another temperature's cannot be derived; sample at generation.temperature 1 or use a local "
                "teacher"
            )
        vocab, scored = self.model.get("vocab_size"), ids[mask.bool()]
        if scored.numel() and (int(scored.min()) < 0 or (vocab and int(scored.max()) >= vocab)):
            raise ValueError(f"token ids outside the served model's vocabulary (0 to {vocab - 1 if vocab else '?'})")
        with self.changed:  # the engine is used under this lock only
            if self.engine.version is None:
                raise ValueError(
                    "the server holds no weights yet (a teacher's server loads them: vllm-serve --teacher)"
                )
            scores = self.engine.prompt_logprobs(ids, mask, start)
            version = self.engine.version
        parsed = WeightsVersion.parse(version)  # a scorer never sees the owner's run
        shown = parsed.step if parsed is not None else str(version)
        return {"op": "logprobs", "version": shown}, {"logprobs": scores.float()}


class _Connection(socketserver.BaseRequestHandler):
    """One training process's connection: the handshake (``hello``, the token's challenge, the run's ownership),
    then requests served in order until ``bye``, the connection closes or it idles past ``--idle_timeout``."""

    server: GenerationServer
    group: WeightGroup | None = None  #: this connection's weight channel (``channel``), if it opened one
    run: str | None = None  #: the run this connection belongs to, once it has proved the token
    #: ``hello``'s role: a ``scorer`` (a served teacher's client) joins no run and only scores; a ``pusher`` joins
    #: its run but only pushes (no batch waits for it, it holds no load back)
    role = "trainer"
    seat: Seat | None = None  #: how batching and the load gate see this connection (a trainer's or a pusher's)

    def finish(self) -> None:
        if self.group is not None:
            self.group.close()
        self.leave()
        self.server.closed()

    def leave(self) -> None:
        """Count this connection out of its run (the run frees the server with its last connection)."""
        run, self.run = self.run, None
        if run is not None:
            self.server.queue.seats.pop(id(self), None)
            self.server.ownership.leave(run)

    def refuse(self, peer: str, message: str) -> None:
        """Answer ``error`` and close (a handshake that failed)."""
        self.server.log(f"{peer}: refused: {message}")
        try:
            send_frame(self.request, {"op": "error", "message": message})
        except OSError:
            pass

    def handshake(self, peer: str) -> bool:
        """``hello`` -> ``challenge``, ``auth`` -> ``ready``: the connection proves the token and its run joins
        the server's owner; else it is refused. Frames here are small and carry no tensors."""
        sock, server = self.request, self.server
        sock.settimeout(server.limits.handshake_timeout)
        hello, _ = read_frame(sock, no_tensors, HANDSHAKE_HEADER)
        run, rank, role = hello.get("run"), hello.get("rank"), hello.get("role", "trainer")
        if hello["op"] != "hello":
            self.refuse(peer, f"a connection starts with 'hello', not {hello['op']!r}")
            return False
        if hello.get("protocol") != PROTOCOL:
            self.refuse(peer, f"hello: protocol {hello.get('protocol')} (this server speaks {PROTOCOL})")
            return False
        if not isinstance(run, str) or not run or type(rank) is not int or role not in ROLES:
            self.refuse(peer, f"hello: needs a run id, a rank and a role ({' or '.join(ROLES)})")
            return False
        nonce = secrets.token_hex(16)
        send_frame(sock, {"op": "challenge", "nonce": nonce})
        auth, _ = read_frame(sock, no_tensors, HANDSHAKE_HEADER)
        given = auth.get("proof") if auth["op"] == "auth" else None
        if not isinstance(given, str) or not hmac.compare_digest(given, proof(server.token, nonce, run, rank)):
            self.refuse(peer, "hello: the token does not match this server's (docs/vllm.md, Server mode)")
            return False
        self.role = role
        if role != "scorer":  # a scorer only scores: it never owns the server, locks no run out, no batch waits for it
            try:
                server.ownership.join(run)
            except PermissionError as err:
                self.refuse(peer, f"hello: {err}")
                return False
            self.run, self.seat = run, Seat(run, rank)
            if role == "trainer":
                server.queue.seats[id(self)] = self.seat
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # the step only: the run's id in ``run:step`` would let a token holder reconnect as the owner (issue 40)
        held = WeightsVersion.parse(server.engine.version)
        version = held.step if held is not None else server.engine.version
        ready = {"op": "ready", "model": server.model, "version": version, "device": device}
        send_frame(sock, {**ready, "fixed": server.fixed, "engine": getattr(server.engine, "kind", "vLLM")})
        return True

    def check(self, header: dict[str, Any], entries: list[Entry]) -> None:
        """``read_frame``'s check of a request: only ``sample`` (its prompts) and ``logprobs`` (the scored rows) carry
        tensors, int64, within the cap."""
        op = header["op"]
        if op not in ("sample", "logprobs"):
            return no_tensors(header, entries)
        names = PROMPTS if op == "sample" else SCORED
        if sorted(name for name, _, _ in entries) != sorted(names) or any(d != torch.int64 for _, d, _ in entries):
            raise FrameError(f"a {op} request carries {' and '.join(names)} (int64), nothing else")
        declared, cap = sum(nbytes(d, shape) for _, d, shape in entries), self.server.limits.max_request_bytes
        if declared > cap:
            raise FrameError(f"a {op} request of {declared} bytes is over the server's {cap}-byte cap")

    def handle(self) -> None:
        sock, server = self.request, self.server
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = ":".join(map(str, self.client_address[:2]))
        try:
            if not self.handshake(peer):
                return
        except (OSError, FrameError) as err:
            server.log(f"{peer}: hello: {one_line(err)}; connection closed")
            return
        while True:
            sock.settimeout(server.limits.idle_timeout)
            try:
                request, tensors = read_frame(sock, self.check)
            except TimeoutError:
                self.refuse(peer, f"idle for {server.limits.idle_timeout:g} s (--idle_timeout); connection closed")
                return
            except (OSError, FrameError) as err:
                if not isinstance(err, ConnectionError) or "mid-frame" in str(err):
                    server.log(f"{peer}: {one_line(err)}; connection closed")
                return
            op = request["op"]
            try:
                if op == "bye":
                    self.leave()
                    send_frame(sock, {"op": "bye"})
                    return
                if self.role == "scorer" and op != "logprobs":
                    raise ValueError("a scorer's connection (a served teacher's client) sends logprobs and bye only")
                if self.role == "pusher" and op != "load":
                    raise ValueError("a pusher's connection (a trainer's second one) sends load and bye only")
                if op == "channel":
                    if server.fixed:
                        raise ValueError(
                            "this server serves a teacher's fixed weights (vllm-serve --teacher): no pushes"
                        )
                    self.group = server.open_channel(sock, request)  # answered before the trainer joins
                    continue
                if op == "load":
                    if request.get("via") == "group" and self.group is None:
                        raise FrameError("weights pushed by the weight channel before a 'channel' request")
                    group = self.group if request.get("via") == "group" else None
                    in_flight = bool(request.get("in_flight", False))
                    answer, out = server.load(sock, self.seat, request.get("version"), group, in_flight), {}
                elif op == "sample":
                    answer, out = server.sample(request, tensors, self.seat)
                elif op == "logprobs":
                    answer, out = server.logprobs(request, tensors)
                else:
                    raise ValueError(f"unknown request {op!r}")
            except (OSError, FrameError) as err:  # the connection is unusable
                server.log(f"{peer}: {op}: {one_line(err)}; connection closed")
                return
            except Exception as err:  # noqa: BLE001 - a refused request is answered, the server goes on
                why = str(err) if isinstance(err, PushRefused) else one_line(err)
                server.log(f"{peer}: {op} refused: {why}")
                answer, out = {"op": "error", "message": f"{op}: {why}"}, {}
            try:
                send_frame(sock, answer, out)
            except OSError:
                return
