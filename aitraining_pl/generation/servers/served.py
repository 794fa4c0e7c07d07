"""``ServedBackend``: the ``GenerationBackend`` of server mode (``generation.server: connect`` / ``launch``, vLLM's
``vllm.mode: server``) over a ``Replica``: one server's ``HTTPReplica`` (a fleet of one), or anything that answers
the same calls (``generation.servers.fleet`` wraps N of them).

Rank 0 pushes the policy's weights before each rollout whose weights changed (``sync``; the optimizer step moved),
streamed one tensor at a time (``policy_weights``; under FSDP2 every rank takes part in gathering each tensor); a
LoRA policy pushes its unmerged base weights once and then its adapter alone (``adapters``; merged weights under
FSDP2 or for adapters a server cannot load); the other ranks walk the same stream and record the version. Each
sample request names the version it needs (``WeightsVersion(run, step)``), and the replica answers it only once the
server serves it, so no rank samples from stale weights. A push that is not ``in_flight`` waits until the rollouts
already being sampled are answered (each is sampled by the version it named); an ``in_flight`` one (``async_schedule:
free``) lands at once, between two decode steps of the HF server or of a vLLM paused with ``/pause?mode=keep``.

Before the first rollout the connection is checked: a server another machine can reach must require a token
(``auth.TokenMiddleware``: it answers 401 without one); one that does not is refused, unless
``generation.vllm.allow_unauthenticated`` is set, and then a warning says so once. A server that cannot be reached is
one ``GenerationServerError`` line (a single server: nowhere else to send the request)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

import torch

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.backend import SampledTokens, SampleRequest
from aitraining_pl.generation.servers.adapters import adapter_weights, supported
from aitraining_pl.generation.servers.auth import TOKEN_ENV
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.replica import ReplicaDown
from aitraining_pl.generation.servers.routing import ReplicaRequest
from aitraining_pl.generation.servers.tcp_wire import token_path
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.lora import is_peft_model, plain_weights
from aitraining_pl.models.sharding import is_sharded
from aitraining_pl.models.weights import policy_weights

#: what ``generation.vllm.protocol: tcp`` and ``aitraining-pl serve`` say once: the frame protocol retires
TCP_RETIRES = (
    "the frame protocol of `aitraining-pl serve` (generation.vllm.protocol: tcp) is deprecated and goes in the next "
    "release: serve rollouts from `vllm serve` or the HF server over HTTP (the default; docs/fleet.md)"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def find_token(options: Any, setting: str = "generation.vllm.server_token_file") -> str | None:
    """The run's token for a server: the file ``options.server_token_file``, else ``TOKEN_ENV``, else for a server
    on this machine the file ``aitraining-pl vllm-serve`` wrote (``tcp_wire.token_path``), else None (a server
    without the middleware)."""
    if options.server_token_file:
        try:
            token = open(options.server_token_file).read().strip()
        except OSError as err:
            raise ConfigError(setting, f"cannot read the server token {options.server_token_file} "
                                       f"({err.strerror or err})") from None  # fmt: skip
        if not token:
            raise ConfigError(setting, f"the server token file {options.server_token_file} is empty")
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = token_path(options.server_port)  # where ``aitraining-pl vllm-serve`` on this machine wrote its own
    return path.read_text().strip() or None if is_loopback(options.server_host) and path.is_file() else None


_warned_open: set[str] = set()


def check_guarded(replica: HTTPReplica, allow: bool, setting: str = "generation.vllm") -> None:
    """Refuse a server that other machines can reach and that answers without a token (no ``TokenMiddleware``),
    unless ``allow`` (``allow_unauthenticated``); then warn once per URL."""
    host = urlparse(replica.url).hostname or ""
    if is_loopback(host):
        return
    import httpx

    try:
        open_door = httpx.get(f"{replica.url}/collective_rpc", timeout=10.0).status_code != 401
    except httpx.TransportError:
        return  # unreachable: the first request says so
    if not open_door:
        return
    if not allow:
        raise ConfigError(
            f"{setting}.server_host",
            f"the server at {replica.url} answers without a token and other machines can reach it: anyone there "
            "could push weights. Start it with --middleware aitraining_pl.generation.servers.auth.TokenMiddleware "
            f"and {TOKEN_ENV} (docs/vllm.md), or set {setting}.allow_unauthenticated: true",
        )
    if replica.url not in _warned_open:
        _warned_open.add(replica.url)
        warnings.warn(f"the generation server {replica.url} takes requests without a token "
                      f"({setting}.allow_unauthenticated)", UserWarning, stacklevel=3)  # fmt: skip


class _Gate:
    """Rollouts in flight (many at once) against a push (alone, once they are answered)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sampling = 0
        self.pushing = False

    @contextlib.contextmanager
    def sample(self) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: not self.pushing)
            self.sampling += 1
        try:
            yield
        finally:
            with self.cond:
                self.sampling -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def push(self) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: not self.pushing and self.sampling == 0)
            self.pushing = True
        try:
            yield
        finally:
            with self.cond:
                self.pushing = False
                self.cond.notify_all()


class ServedBackend:
    """Server mode's backend (see the module docstring).

    Args:
        replica: one server's client (``HTTPReplica``) or a fleet.
        rank: this process's global rank; rank 0 pushes.
        run: the run's id (the same on every rank).
        timeout: seconds a rollout may take, besides a fixed connect timeout.
        sync_weights: False: push only once (debugging).
    """

    location = "server"

    @classmethod
    def from_context(cls, generation: Any, context: Any) -> Any:
        """The backend for ``generation.vllm``'s server and a ``BackendContext`` (``registry.BACKENDS``): this one
        over an ``HTTPReplica``, or with ``protocol: tcp`` the deprecated frame protocol's client."""
        options = generation.vllm
        if options.protocol == "tcp":
            from aitraining_pl.generation.servers.client import VLLMServerClient

            warnings.warn(TCP_RETIRES, FutureWarning, stacklevel=2)

            return VLLMServerClient.from_context(generation, context)
        replica = HTTPReplica(f"http://{options.server_host}:{options.server_port}", find_token(options),
                              timeout=options.server_timeout)  # fmt: skip
        check_guarded(replica, bool(getattr(options, "allow_unauthenticated", False)))
        return cls(replica, context.rank, context.run, options.server_timeout, options.sync_weights)

    def __init__(self, replica: Any, rank: int = 0, run: str | None = None, timeout: float = 240.0,
                 sync_weights: bool = True):  # fmt: skip
        self.replica, self.rank, self.run = replica, int(rank), run or uuid.uuid4().hex
        self.timeout, self.sync_weights = float(timeout), bool(sync_weights)
        self._version: WeightsVersion | None = None
        self.sync_seconds = 0.0  #: time the last push took (rank 0)
        self.cached_tokens = 0  #: not reported by the servers' completions
        self.pushes = 0
        self.base_pushed = False  #: a LoRA policy's unmerged base weights are on the server
        self._gate = _Gate()

    @property
    def version(self) -> WeightsVersion | None:
        """The weights version this process's rollouts need (the asynchronous pipeline pins it per job, as
        ``run:step`` text or a ``WeightsVersion``)."""
        return self._version

    @version.setter
    def version(self, value: Any) -> None:
        self._version = WeightsVersion.parse(value)

    def sync(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """Rank 0: push ``policy``'s weights unless the server already holds ``version``; the other ranks walk
        the weights (a collective under FSDP2) and record the version. Whether the weights changed."""
        if is_peft_model(policy) and not is_sharded(policy) and supported(policy):
            return self.push_adapter(policy, version)
        walk = self.rank == 0 or is_sharded(policy)
        return self.push(policy_weights(policy) if walk else iter(()), version)

    @torch.no_grad()
    def push_adapter(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """A LoRA policy (``sync``): the unmerged base weights once, then its adapter alone at each push
        (``adapters``); rank 0 only (nothing to gather)."""
        key = self.key(version)
        if self.version is not None and (key == self.version or not self.sync_weights):
            return False
        if self.rank == 0:
            with self._gate.push():
                try:
                    seconds = 0.0
                    if not self.base_pushed:
                        seconds += self.replica.push(plain_weights(policy, merged=False), key).seconds
                        self.base_pushed = True
                    self.sync_seconds = seconds + self.replica.push(adapter_weights(policy), key).seconds
                except ReplicaDown as err:
                    raise self.down(err) from None
        self.pushes += 1
        self.version = key
        return True

    def key(self, version: Any) -> WeightsVersion:
        """The ``WeightsVersion`` of a push of ``version`` (an optimizer step; None: this backend's own count)."""
        return WeightsVersion(self.run, self.pushes if version is None else int(version))

    @torch.no_grad()
    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: Any = None, in_flight: bool = False) -> bool:
        """Rank 0: push ``weights`` as ``version`` (an optimizer step; None: the next of this backend's own count)
        unless the server holds it; ``in_flight``: without waiting for the rollouts being sampled. Other ranks
        consume ``weights``. Whether the weights changed."""
        key = self.key(version)
        if self.version is not None and (key == self.version or not self.sync_weights):
            return False
        self.base_pushed = False  # full weights: a LoRA adapter's base must go again before the next adapter
        if self.rank != 0:
            for _ in weights:
                pass
        else:
            gate = self._gate.push() if not in_flight else contextlib.nullcontext()
            with gate:
                try:
                    self.sync_seconds = self.replica.push(weights, key).seconds
                except ReplicaDown as err:
                    raise self.down(err) from None
        self.pushes += 1
        self.version = key
        return True

    def sample(self, request: SampleRequest) -> SampledTokens:
        """The server's samples of the left-padded prompts, by the weights of this process's version."""
        request = ReplicaRequest.of(request, self.version)  # the weights it must be sampled by
        deadline = time.monotonic() + self.timeout
        try:
            self.replica.wait_for(self.version, deadline)
            with self._gate.sample():
                return self.replica.sample(request, deadline)
        except ReplicaDown as err:
            doing = f"sampling {request.num_samples} responses for each of {request.prompt_ids.shape[0]} prompts"
            raise self.down(err, doing) from None

    def down(self, err: ReplicaDown) -> GenerationServerError:
        """The one line of a server that cannot be reached (a single server: nowhere else to send the request)."""
        what = str(err).removeprefix(f"{self.replica.url}: ")
        return GenerationServerError(
            f"generation server {self.replica.url}",
            f"{what}; a run that had started resumes from its last checkpoint with --ckpt_path",
        )

    def sleep(self) -> None:
        """Nothing to free: the server's memory is its own."""

    def close(self) -> None:
        self.replica.close()

    def stats(self) -> dict[str, torch.Tensor]:
        """None to log (``GenerationBackend.stats``)."""
        return {}
