"""A fleet member (``generation.servers.fleet.Replica``) over the client of ``aitraining-pl serve``'s own frames
(``generation.servers.client``): the ``tcp://host:port`` URLs of ``generation.server.urls``, for the release in which
that protocol stays.

A ``TCPReplica`` connects when first used and again after its server was lost (``alive``, asked by the fleet
before a push to a server it marked down). A lost connection, a refused connection and a deadline passed are
``ReplicaDown`` (the fleet re-sends the requests); a refused request or token stays the client's one-line
``GenerationServerError`` / ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import torch

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampledTokens
from aitraining_pl.generation.servers.client import VLLMServerClient
from aitraining_pl.generation.servers.replica import PushReport, ReplicaDown, ReplicaStats
from aitraining_pl.generation.servers.served import TCP_RETIRES
from aitraining_pl.generation.servers.weights import ChannelBroken
from aitraining_pl.generation.version import WeightsVersion


class _Client(VLLMServerClient):
    """The server client with a lost connection raised as ``ReplicaDown``."""

    def lost(self, doing: str, err: OSError) -> ReplicaDown:
        if isinstance(err, socket.timeout):
            return ReplicaDown(f"no answer by its deadline while {doing}")
        what = str(err) if isinstance(err, ChannelBroken) else f"the connection was lost ({err.strerror or err})"
        return ReplicaDown(f"{what} while {doing}")


class TCPReplica:
    """One ``aitraining-pl serve`` as a fleet member.

    Args:
        url: ``tcp://host:port``.
        generation: the run's ``generation`` (its ``vllm`` options: the token file, ``sync_weights``).
        context: the ``BackendContext`` (policy, rank, run).
        token_file: the server's token file (a launched server's); else as the client finds it.
        connect_timeout: seconds to keep trying to connect.
    """

    def __init__(self, url: str, generation: Any, context: Any, token_file: str | None = None, connect_timeout=30.0):
        warnings.warn(TCP_RETIRES, FutureWarning, stacklevel=2)
        parts = urlsplit(url)
        self.url, self.context, self.stats = url, context, ReplicaStats()
        self.options = dataclasses.replace(
            generation.vllm,
            server_host=parts.hostname,
            server_port=int(parts.port),
            server_token_file=token_file or generation.vllm.server_token_file,
            server_timeout=float(connect_timeout),
        )
        self.client: _Client | None = None
        self.lock = threading.Lock()  #: one request at a time on the connection (the server batches the ranks')
        self.connecting = threading.Lock()
        self.in_flight = False  #: between ``pause`` and ``resume``: the push is taken between decode steps

    def connected(self) -> _Client:
        with self.connecting:
            if self.client is None:
                try:
                    self.client = _Client(self.context.policy, self.options, self.context.rank, self.context.run)
                except GenerationServerError as err:
                    if "could not connect" not in str(err):
                        raise
                    raise ReplicaDown(f"nothing listening at {self.url}") from None
            return self.client

    def dropped(self) -> None:
        with self.connecting:
            client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except OSError:
                pass

    def sample(self, request: Any, deadline: float) -> SampledTokens:
        with self.lock:
            client = self.connected()
            client.version = None if request.version is None else str(request.version)
            client.at_least = bool(request.newer)
            client.sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                return client.sample(request)
            except ReplicaDown:
                self.dropped()
                raise

    def outstanding_tokens(self) -> int:
        return 0  # the fleet counts what it sent

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: WeightsVersion) -> PushReport:
        client, size = self.connected(), 0

        def counted():
            nonlocal size
            for name, tensor in weights:
                size += tensor.numel() * tensor.element_size()
                yield name, tensor

        try:
            client.push(counted(), version.step, in_flight=self.in_flight)
        except ReplicaDown:
            self.dropped()
            raise
        return PushReport(client.sync_seconds, size)

    def pause(self) -> None:
        self.in_flight = True  # the HF server takes an in-flight push between two decode steps itself

    def resume(self) -> None:
        self.in_flight = False

    def alive(self) -> bool:
        """Whether the server accepts a connection now (one try, then the client's ``hello``)."""
        if self.client is None:
            try:
                socket.create_connection((self.options.server_host, self.options.server_port), timeout=2.0).close()
            except OSError:
                return False
        try:
            self.connected()
            return True
        except ReplicaDown:
            return False

    def close(self) -> None:
        self.dropped()
