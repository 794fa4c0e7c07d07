"""The trainer's side of server mode (``generation: {backend: vllm, vllm: {mode: server}}``, TRL's ``vllm_mode:
server``): a client of ``aitraining-pl serve`` (``vllm-serve``; ``servers.tcp_server``, a vLLM or an HF engine)
with the colocated engine's interface (``sync``, ``sample``, ``sleep``, ``close``), so the rollout engine and the
online modules use either alike.

Every training process connects on its own and sends its own prompts; rank 0 pushes the policy's weights before
each rollout whose weights changed (the optimizer step count moved; once per rollout, as the colocated sync),
streamed one tensor at a time (a LoRA policy's base weights with the deltas merged, ``models.lora.plain_weights``;
under FSDP2 every rank takes part in gathering each tensor, and rank 0 sends it): over the framing of
``generation.servers.tcp_wire`` (``weight_channel: tcp``), or by broadcast on a two-member process group with the server
(``nccl`` GPU to GPU, ``gloo`` on CPUs; ``generation.servers.weights``), the frames then naming each tensor only.
A sample request names the weights version it needs (the run's id and the step count), and the server answers it
only once it holds that version (with ``at_least``: that version or a later one of the run), so the other ranks
never sample from stale weights; each answer says which step sampled each token (``SampledTokens.token_versions``).
An asynchronous trainer pushes a snapshot taken earlier (``push``) from another thread while its rollouts are
generated: over a second connection when the first waits for an answer, and with ``in_flight`` an engine that
allows it (the HF engine) takes the weights between two decode steps. This module does not import vLLM: the
trainer's processes need not have it installed.

Every connection proves the server's token at ``hello`` (``wire.proof``: an HMAC of the server's nonce; the token
never travels): from ``generation.vllm.server_token_file``, else ``AITRAINING_PL_SERVER_TOKEN``, else, for a server
on this machine, the owner-only file ``vllm-serve`` wrote (``wire.token_path``). Any failure of the channel
(nothing listening, a timeout, the server gone mid-run, a refused request or token) is one
``GenerationServerError`` line naming ``host:port`` and what was being done; the token is never in it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.backend import SampledTokens, SampleRequest
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers.tcp_guards import read_token
from aitraining_pl.generation.servers.tcp_wire import (
    MODEL_FIELDS,
    PROTOCOL,
    RESUME,
    TOKEN_ENV,
    FrameError,
    describe,
    is_loopback,
    model_description,
    proof,
    read_frame,
    send_frame,
    token_path,
)
from aitraining_pl.generation.servers.weights import ChannelBroken, WeightGroup, failure
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.sharding import is_sharded
from aitraining_pl.models.weights import policy_weights


def find_token(options: VLLMConfig, setting: str = "generation.vllm.server_token_file") -> tuple[str, str]:
    """The server's token and where it came from (for messages; never the token itself):
    ``options.server_token_file`` (the option ``setting``), else ``TOKEN_ENV``, else the file ``vllm-serve`` writes
    on loopback."""
    if options.server_token_file:
        return read_token(options.server_token_file), f"{setting} {options.server_token_file}"
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV], f"${TOKEN_ENV}"
    path = token_path(options.server_port)
    if is_loopback(options.server_host) and path.is_file():
        return read_token(path), str(path)
    where = f"{options.server_host}:{options.server_port}"
    raise ConfigError(
        setting,
        f"no token for the generation server at {where}: set {TOKEN_ENV} or {setting} "
        f"to the server's (a vllm-serve on this machine that made its own writes it to {path}); docs/vllm.md, "
        "Server mode",
    )


def weight_channel(name: str, policy: torch.nn.Module | str, server_device: str | None) -> str:
    """``tcp``, ``nccl`` or ``gloo`` for ``generation.vllm.weight_channel`` ``name``: ``auto`` is ``nccl`` when the
    policy (a module, or the device type its weights are on) and the server are both on GPUs (and this torch has
    NCCL), else ``tcp``. ``nccl`` with either side on a CPU is a ``ConfigError``."""
    import torch.distributed as dist

    policy_device = policy if isinstance(policy, str) else next(policy.parameters()).device.type
    on_gpu = policy_device == "cuda" and server_device == "cuda"
    if name == "auto":
        return "nccl" if on_gpu and dist.is_nccl_available() else "tcp"
    if name == "nccl" and not on_gpu:
        where = f"the policy on {policy_device}, the server on {server_device}"
        raise ConfigError("generation.vllm.weight_channel", f"nccl needs GPUs on both sides ({where}): tcp or gloo")
    return name


class VLLMServerClient:
    """A connection to a generation server for one training process.

    Args:
        policy: the policy being trained (its config is checked against the server's model).
        options: ``server_host``, ``server_port``, ``server_timeout`` and ``sync_weights`` are read.
        rank: this process's global rank; rank 0 pushes the weights.
        run: an id shared by the run's ranks (rank 0's, broadcast), so that weights pushed by an earlier run
            to the same server never count as this run's.
    """

    location = "server"  #: a ``GenerationBackend`` in another process (``aitraining-pl serve``)
    role = "trainer"  #: ``hello``'s role (a ``scorer`` joins no run, ``ServedTeacher``; a ``pusher`` only pushes)
    kind = "generation server"  #: how messages name the server (after ``ready``: by its engine, "vLLM server")
    at_least = False  #: ask for this process's weights version or any later one of the run (``newer``)
    setting = "generation.vllm"  #: where the connection's options are set (messages)
    starting = "starting the rollouts"  #: what a failed connection was for (messages)

    @classmethod
    def from_context(cls, generation: Any, context: Any) -> VLLMServerClient:
        """The client for ``generation.vllm`` and a ``generation.backend.BackendContext`` (``registry.BACKENDS``)."""
        return cls(context.policy, generation.vllm, context.rank, context.run)

    def __init__(self, policy: torch.nn.Module, options: VLLMConfig, rank: int = 0, run: str | None = None):
        self.options, self.rank = options, int(rank)
        self.address = f"{options.server_host}:{options.server_port}"
        self.run = run or uuid.uuid4().hex
        self.version: str | None = None  #: the weights version this process's rollouts need
        self.calls = itertools.count()
        self.sync_seconds = 0.0  #: time the last weight push took (rank 0)
        self.group: WeightGroup | None = None  #: rank 0's collective weight channel, when one is used
        self.cached_tokens = 0  #: prompt tokens of the last ``sample`` found in the server's prefix cache
        self.batched = 0  #: requests (of all ranks) the server's ``generate`` that drew the last ``sample`` served
        self.talking = threading.Lock()  #: held by a request on ``sock`` until its answer (``sample``, ``push``)
        self.pusher: VLLMServerClient | None = None  #: the second connection ``push`` uses while ``sock`` is busy
        if not 1 <= int(options.server_port) <= 65535:
            raise ConfigError(
                "generation.vllm.server_port",
                f"must be the server's port, 1 to 65535, got {options.server_port} (vllm-serve --port 0 picks a free "
                "port and prints it: give the trainer that one)",
            )
        self.sock = self.connect()
        answer = self.hello()
        engine = answer.get("engine", "vLLM")  # a server that does not say is a vLLM one
        self.kind = f"{engine} server" if isinstance(engine, str) and engine.isalnum() else self.kind
        served, ours = answer.get("model") or {}, model_description(base_model(policy).config)
        wrong = [f"{k} {served.get(k)!r} (the policy's: {ours[k]!r})" for k in MODEL_FIELDS if served.get(k) != ours[k]]
        if wrong:
            self.close()
            raise ConfigError(
                "generation.vllm",
                f"the server at {self.address} serves another model: {', '.join(wrong)}; start vllm-serve with the "
                "policy's config (--model)",
            )
        self.server_device = answer.get("device")  #: where the server's engine runs (``ready``)
        self.channel_chosen = self.rank != 0  #: rank 0 chooses at its first push (``choose_channel``)

    def hello(self) -> dict[str, Any]:
        """``hello``, then the answer to the server's challenge (the token's proof): the server's ``ready``."""
        hello = {"op": "hello", "protocol": PROTOCOL, "rank": self.rank, "run": self.run, "role": self.role}
        challenge, _ = self.call(hello, "connecting")
        if not isinstance(challenge.get("nonce"), str):
            self.close()
            raise self.error("connecting", f"the server answered {challenge['op']!r} to hello, not a challenge")
        try:
            token, source = find_token(self.options, f"{self.setting}.server_token_file")
            answer, _ = self.call({"op": "auth", "proof": proof(token, challenge["nonce"], self.run, self.rank)},
                                  "connecting")  # fmt: skip
        except (ConfigError, GenerationServerError) as err:
            self.close()
            if isinstance(err, ConfigError) or "the token does not match" not in str(err):
                raise
            raise GenerationServerError(
                f"{self.kind} {self.address}",
                f"it refused the token from {source}: give the trainer the server's token ({TOKEN_ENV} or "
                f"{self.setting}.server_token_file; docs/vllm.md, Server mode)",
            ) from None
        return answer

    def open_channel(self, backend: str) -> None:
        """Rank 0: open the collective weight channel ``backend`` (nothing for ``tcp``)."""
        if backend == "tcp":
            return
        timeout = float(self.options.server_timeout)
        doing = f"opening the {backend} weight channel (generation.vllm.weight_channel)"
        answer, _ = self.call({"op": "channel", "backend": backend}, doing)
        try:
            self.group = WeightGroup(backend, timeout, host=self.options.server_host, port=int(answer["port"]))
        except RuntimeError as err:
            self.close()
            raise self.error(doing, f"could not join it on port {answer['port']} ({failure(err)})") from None

    # ------------------------------------------------------------------ channel
    def error(self, doing: str, what: str) -> GenerationServerError:
        return GenerationServerError(f"{self.kind} {self.address}", f"{what} while {doing}; {RESUME}")

    def connect(self) -> socket.socket:
        """A connection to the server, retried until ``server_timeout`` (the server may still be starting)."""
        options = self.options
        host, port, timeout = options.server_host, int(options.server_port), float(options.server_timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as err:
                if time.monotonic() >= deadline:
                    raise GenerationServerError(
                        f"{self.kind} {self.address}",
                        f"could not connect for {timeout:g} s ({self.setting}.server_timeout) while {self.starting} "
                        f"({err.strerror or err}): start it first (aitraining-pl serve --model ... "
                        f"--port {port}; docs/vllm.md, Server mode); a run that had started resumes from its last "
                        "checkpoint with --ckpt_path",
                    ) from None
                time.sleep(0.25)
        sock.settimeout(timeout + 5.0)  # the server answers a version that never arrives itself, after timeout
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def call(
        self, header: Mapping[str, Any], doing: str, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Send one request and read its answer; every failure is one ``GenerationServerError``."""
        try:
            send_frame(self.sock, header, tensors)
            return self.answer(doing)
        except OSError as err:
            raise self.lost(doing, err) from None

    def answer(self, doing: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        try:
            answer, tensors = read_frame(self.sock)
        except FrameError as err:
            raise self.error(doing, f"the server broke the framing ({err})") from None
        if answer["op"] == "error":
            raise self.error(doing, f"the server refused: {answer.get('message', '')}")
        return answer, tensors

    def lost(self, doing: str, err: OSError) -> GenerationServerError:
        if isinstance(err, socket.timeout):
            what = f"no answer within {self.options.server_timeout:g} s ({self.setting}.server_timeout)"
        elif isinstance(err, ChannelBroken):
            what = str(err)
        else:
            what = f"the connection was lost ({err.strerror or err})"
        return self.error(doing, what)

    # ------------------------------------------------------------------ the engine's interface
    def sync(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """Rank 0: push ``policy``'s weights unless the server already holds ``version`` from this run (or
        ``sync_weights`` is off after the first push); the other ranks record the version their next rollout
        needs (under FSDP2 they walk the weights with rank 0: gathering each tensor is a collective). Returns
        whether the weights changed."""
        walk = self.rank == 0 or is_sharded(policy)
        return self.push(policy_weights(policy) if walk else iter(()), version)

    @torch.no_grad()
    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: Any = None, in_flight: bool = False) -> bool:
        """Rank 0: push ``weights`` (``(name, tensor)`` pairs under the transformers names, e.g. a CPU snapshot
        taken earlier) as ``version`` of this run, unless the server already holds it (or ``sync_weights`` is off
        after the first push); the other ranks consume ``weights`` and record the version. Callable from any
        thread: over this connection (and its weight channel) when no request of another thread is waiting on it,
        else over a second connection (a ``pusher``, TCP frames). ``in_flight``: an engine that allows it (the HF
        engine) takes the weights between two decode steps of a running batch instead of after it. Returns
        whether the weights changed."""
        key = str(WeightsVersion(self.run, next(self.calls) if version is None else int(version)))
        if self.version is not None and (key == self.version or not self.options.sync_weights):
            return False
        if self.rank != 0:
            for _ in weights:
                pass
        elif self.talking.acquire(blocking=False):
            try:
                weights = self.choose_channel(weights)
                self.send_weights(weights, key, version, in_flight)
            finally:
                self.talking.release()
        else:
            if self.pusher is None:
                self.pusher = _Pusher(self)
            self.pusher.send_weights(weights, key, version, in_flight)
            self.sync_seconds = self.pusher.sync_seconds
        self.version = key
        return True

    def choose_channel(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Rank 0's first push: open the weight channel for the device of the first tensor pushed (here, not when
        the client is built: at ``setup`` Lightning has not yet moved the policy to its GPU); ``weights`` again."""
        if self.channel_chosen:
            return weights
        weights = iter(weights)
        first = next(weights, None)
        device = first[1].device.type if first is not None else "cpu"
        self.open_channel(weight_channel(self.options.weight_channel, device, self.server_device))
        self.channel_chosen = True
        return weights if first is None else itertools.chain([first], weights)

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], key: str, version: Any, in_flight: bool):
        """Send one push (``load``, a ``weight`` frame per tensor, ``end``) on this connection and read its answer."""
        doing = f"pushing the weights of version {version}"
        start = time.perf_counter()
        try:
            group = self.group
            via = "frames" if group is None else "group"
            send_frame(self.sock, {"op": "load", "version": key, "via": via, "in_flight": bool(in_flight)})
            count = 0
            for name, tensor in weights:
                if group is None:
                    send_frame(self.sock, {"op": "weight"}, {name: tensor})
                else:
                    send_frame(self.sock, {"op": "weight", "tensor": describe(name, tensor)})
                    group.send(tensor)
                count += 1
            send_frame(self.sock, {"op": "end", "count": count})
            self.answer(doing)
        except OSError as err:  # the connection or the weight channel (``ChannelBroken``) is gone
            self.close()  # a collective group left open to a dead peer aborts the process at exit
            raise self.lost(doing, err) from None
        self.sync_seconds = time.perf_counter() - start

    def sample(self, request: SampleRequest) -> SampledTokens:
        """The engine's ``sample`` on the server, once it holds this process's weights version (or with
        ``at_least`` a later one): the same ``SamplingParams`` (the server rebuilds ``generation`` and the stop
        rule's strings from the request). ``token_versions``: the step of the weights that sampled each token
        (None from a server that does not say)."""
        if request.images is not None:
            raise ConfigError("generation.vllm.protocol", "prompts with images need the engine's HTTP routes (http): "
                              "the frame protocol (tcp, deprecated) carries no images")  # fmt: skip
        generation, stop_rule, num_samples = request.generation, request.stop_rule, request.num_samples
        prompt_ids, prompt_mask = request.prompt_ids, request.prompt_mask
        fields = {k: v for k, v in dataclasses.asdict(generation).items() if k != "vllm"}
        message = {
            "op": "sample",
            "version": self.version,
            "newer": bool(self.at_least),
            "timeout": float(self.options.server_timeout),
            "generation": fields,
            "end_ids": [int(t) for t in request.end_ids],
            "stop_strings": list(stop_rule.stop_strings),
            "skip_special_tokens": bool(stop_rule.skip_special_tokens),
            "pad_token_id": int(request.pad_token_id),
            "num_samples": int(num_samples),
            "seed": request.seed,
        }
        prompts = {"prompt_ids": prompt_ids.long(), "prompt_mask": prompt_mask.long()}
        doing = f"sampling {num_samples} responses for each of {prompt_ids.shape[0]} prompts (rank {self.rank})"
        with self.talking:
            answer, tensors = self.call(message, doing, prompts)
        self.cached_tokens, self.batched = int(answer.get("cached_tokens", 0)), int(answer.get("batched", 1))
        device = prompt_ids.device
        logprobs, versions = tensors["sampling_logprobs"].to(device), tensors.get("token_versions")
        return SampledTokens(
            tensors["response_ids"].to(device),
            sampling_logprobs=logprobs,
            token_versions=None if versions is None else versions.to(device),
        )

    def sleep(self) -> None:
        """Nothing to free: the server's memory is its own."""

    def close(self) -> None:
        pusher, self.pusher = getattr(self, "pusher", None), None
        if pusher is not None:
            pusher.close()
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            group.close()
        sock, self.sock = getattr(self, "sock", None), None
        if sock is not None:
            try:  # the server's answer says this connection no longer counts for the run (the next run may own it)
                sock.settimeout(5.0)
                send_frame(sock, {"op": "bye"})
                read_frame(sock)
            except (OSError, FrameError):
                pass
            sock.close()

    def stats(self) -> dict[str, torch.Tensor]:
        """None to log (``GenerationBackend.stats``)."""
        return {}


class _Pusher(VLLMServerClient):
    """The second connection of a trainer's rank 0 (``hello`` role ``pusher``): ``VLLMServerClient.push`` sends on
    it while a request of another thread waits on the first (an asynchronous trainer pushes while its rollouts
    are generated). TCP frames only; the server neither batches with it nor holds loads back for it."""

    role = "pusher"

    def __init__(self, owner: VLLMServerClient):  # noqa: D107 - no super(): the owner's settings, no policy
        self.options, self.rank, self.run, self.setting = owner.options, owner.rank, owner.run, owner.setting
        self.address, self.group, self.pusher, self.sync_seconds = owner.address, None, None, 0.0
        self.sock = self.connect()
        self.hello()


class ServedTeacher(VLLMServerClient):
    """A teacher on a generation server (``aitraining-pl vllm-serve --teacher --model <teacher>``): the
    ``TeacherScorer`` of ``modules.distill`` whose ``token_logprobs`` are the server's ``logprobs`` (vLLM's prompt
    log-probs of the given tokens, never re-tokenised), so the teacher need not fit beside the student. It says
    ``hello`` as a ``scorer`` with its own run id: it never owns the server, never pushes and locks no training run
    out. It connects when first used (and again in each process it is copied to); any failure is one
    ``GenerationServerError`` line naming the server.

    Args:
        options: ``server_host``, ``server_port``, ``server_timeout`` and ``server_token_file`` are read.
        setting: where those are configured (messages name it).
    """

    role, kind, starting = "scorer", "teacher server", "scoring with the teacher"
    model = None  #: no model in this process (the reference slot's ``model``)

    def __init__(self, options: VLLMConfig, setting: str = "teacher_server"):  # noqa: D107 - no super(): no policy
        self.options, self.setting, self.rank, self.run = options, setting, 0, uuid.uuid4().hex
        self.address = f"{options.server_host}:{options.server_port}"
        self.group = self.sock = None
        self.served: dict[
            str, Any
        ] = {}  #: ``ready``'s answer: the served model's fields, whether its weights are fixed

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "sock": None}  # a copy (another process) opens its own connection

    def connection(self) -> socket.socket:
        if self.sock is None:
            self.sock = self.connect()
            self.served = self.hello()
        return self.sock

    def vocab_size(self) -> int | None:
        """The served model's ``vocab_size`` (connects)."""
        self.connection()
        return (self.served.get("model") or {}).get("vocab_size")

    def to(self, *args: Any, **kwargs: Any) -> ServedTeacher:
        return self  # the weights live on the server

    @torch.no_grad()
    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, temperature: float
    ) -> torch.Tensor:
        """(N, R) the served teacher's log-probs of the response tokens of rows (N, P + R), float32 (0 on padding)."""
        self.connection()
        request = {"op": "logprobs", "start": int(prompt_length), "temperature": float(temperature)}
        rows = {"input_ids": input_ids.long(), "attention_mask": attention_mask.long()}
        doing = f"scoring {input_ids.shape[0]} rows of {input_ids.shape[1] - prompt_length} tokens with the teacher"
        _, tensors = self.call(request, doing, rows)
        return tensors["logprobs"].to(input_ids.device)
