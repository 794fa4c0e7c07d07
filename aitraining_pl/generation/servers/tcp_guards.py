"""What the generation server (``generation.servers.tcp_server``) checks before it trusts a connection or a push:

- **the token** (``server_token``): the shared secret every connection proves at ``hello`` (``wire.proof``). Given
  by ``AITRAINING_PL_SERVER_TOKEN`` or ``--token_file``; otherwise, on a loopback bind only, generated and written
  to the owner-only ``wire.token_path(port)`` (a server reachable from other machines refuses to start without
  one). The token is never printed; only where it lives.
- **the owner** (``Ownership``): the first authenticated run owns the server while it has a connection open; the
  hello of another run is refused, and the owner's pushes carry versions that only move forward.
- **the push** (``WeightSpecs``): every tensor's name, shape and dtype against the served model's parameters
  before its bytes are read (so a push is at most about the model's size), its values finite, and the whole
  push staged in host memory before the engine loads any of it: a refused push leaves the engine as it was.
- **the limits** (``Limits``): the server's own timeouts (a request's ``timeout`` is bounded by them), idle
  and unauthenticated connections dropped, the number of connections and a request's bytes capped.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers import auth, checks
from aitraining_pl.generation.servers.checks import PushRefused
from aitraining_pl.generation.servers.tcp_wire import (
    TOKEN_ENV,
    Entry,
    FrameError,
    is_loopback,
    nbytes,
    parse_entry,
    read_frame,
    token_path,
)
from aitraining_pl.generation.servers.weights import ChannelBroken, WeightGroup
from aitraining_pl.generation.version import WeightsVersion

#: what a connection may send before it has proved the token: a short header, no tensors
HANDSHAKE_HEADER = 4096


@dataclasses.dataclass
class Limits:
    """The server's bounds (``vllm-serve`` options); none is chosen by the sender of a request."""

    timeout: float = VLLMConfig.server_timeout
    """Seconds a push may stay silent between two frames, a weight channel may take to be joined and a sample
    request may wait for its weights (a request asking for longer, or for a non-finite time, gets this)."""
    idle_timeout: float = 3600.0
    """Seconds an authenticated connection may send nothing before it is dropped (with a last ``error``)."""
    handshake_timeout: float = 30.0
    """Seconds a new connection has to send ``hello`` and prove the token."""
    max_connections: int = 64
    """Open connections at most (one per training process); more are refused with a message."""
    max_request_bytes: int = 256 << 20
    """Most tensor bytes a ``sample`` request may declare (its prompts)."""

    def bound(self, asked: Any) -> float:
        """The seconds to allow for a request that asked for ``asked``: a finite positive number, at most
        ``timeout``."""
        try:
            seconds = float(asked)
        except (TypeError, ValueError):
            return self.timeout
        return min(seconds, self.timeout) if math.isfinite(seconds) and seconds > 0 else self.timeout


class WeightSpecs(checks.WeightSpecs):
    """``checks.WeightSpecs`` (the same checks as the HTTP servers'), with the bound on a declared tensor's bytes and
    the check of a frame's declared tensor before its bytes are read."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        #: the largest tensor a push may declare (a float64 copy of the largest parameter)
        self.largest = max((nbytes(torch.float64, shape) for shape, _ in self.specs.values()), default=0)

    def check_entry(self, entry: Entry, seen: set[str]) -> None:
        """``check`` of a frame's declared tensor (name, dtype, shape)."""
        name, dtype, shape = entry
        self.check(name, dtype, shape, seen)


class Push:
    """The ``weight`` frames of one push, read to its ``end``: each tensor checked against the served model
    (``WeightSpecs``; its name, shape and dtype before its bytes are read) and staged in host memory. After a
    refusal the rest of the push is read and dropped, so the connection stays in step, and ``receive`` raises
    the refusal at the ``end``; a frame that breaks the framing, or declares more bytes than any tensor of the
    model, is a ``FrameError`` (the connection is closed)."""

    def __init__(self, sock: socket.socket, specs: WeightSpecs, group: WeightGroup | None = None):
        self.sock, self.specs, self.group = sock, specs, group
        self.count = 0
        self.seen: set[str] = set()
        self.refused: PushRefused | None = None  #: why the push is refused (the rest of it is dropped)

    def check(self, header: dict[str, Any], entries: list[Entry]) -> bool:
        """``read_frame``'s check: whether to keep the frame's tensor (False: read and drop it)."""
        if header["op"] == "end" and not entries:
            return True
        if header["op"] != "weight" or len(entries) != (0 if self.group else 1):
            raise FrameError(f"expected one tensor per 'weight' frame, got {header['op']!r} with {len(entries)}")
        entry = parse_entry(header.get("tensor")) if self.group else entries[0]
        if nbytes(entry[1], entry[2]) > self.specs.largest:
            raise FrameError(f"{entry[0]!r} declares {nbytes(entry[1], entry[2])} bytes, more than any tensor of "
                             "the served model")  # fmt: skip
        if self.refused is None:
            try:
                self.specs.check_entry(entry, self.seen)
            except PushRefused as err:
                self.refused = err
        self.seen.add(entry[0])
        return self.refused is None

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """The push's tensors, checked and staged; ``PushRefused`` (after its ``end``) when it does not fit."""
        staged: list[tuple[str, torch.Tensor]] = []
        while True:
            header, tensors = read_frame(self.sock, self.check)
            if header["op"] == "end":
                if header.get("count") != self.count:
                    raise FrameError(f"'end' says {header.get('count')} tensors, {self.count} came")
                break
            self.count += 1
            if self.group is not None:
                name, dtype, shape = parse_entry(header["tensor"])
                try:
                    tensors = {name: self.group.receive(dtype, shape)}
                except ChannelBroken as err:  # the trainer left the group: the push cannot go on
                    raise ChannelBroken(f"{err} while receiving {name}") from None
            if self.refused is not None:
                staged.clear()  # the push is refused: hold nothing while the rest of it is read
                continue
            for name, tensor in tensors.items():
                try:
                    staged.append((name, self.specs.stage(name, tensor)))
                except PushRefused as err:
                    self.refused = err
        missing = self.specs.missing(self.seen)
        if self.refused is None and missing:
            self.refused = PushRefused(f"the push lacks {len(missing)} of the served model's tensors ({missing[0]!r}"
                                       + (", ..." if len(missing) > 1 else "") + ")")  # fmt: skip
        if self.refused is not None:
            raise self.refused
        return staged


class Ownership:
    """Which training run the server serves: the first authenticated run, for as long as it keeps a connection
    open (a run that stopped, crashed or finished frees the server for the next one, e.g. its resumption), and
    the last weights version it pushed (versions ``run:step`` only move forward)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: str | None = None
        self.open: Counter[str] = Counter()  #: authenticated connections of each run
        self.step: int | None = None  #: the step of the owner's last push

    def join(self, run: str) -> None:
        """Count a connection of ``run``; ``PermissionError`` when another run owns the server."""
        with self.lock:
            if self.owner is not None and self.owner != run and self.open[self.owner]:
                raise PermissionError(
                    f"this server serves another run ({self.open[self.owner]} connections open); one training "
                    "run per server: stop that run or start another vllm-serve (--port)"
                )
            if self.owner != run:
                self.owner, self.step = run, None
            self.open[run] += 1

    def leave(self, run: str) -> None:
        with self.lock:
            self.open[run] -= 1

    def step_of(self, run: str, version: Any) -> int:
        """The step of ``version`` (``run:step``) pushed by a connection of ``run``; ``PushRefused`` when it is
        empty, of another run or not newer than the last accepted push."""
        parsed = WeightsVersion.parse(version)
        if parsed is None or parsed.run != run:
            raise PushRefused(f"weights version {version!r} is not one of this run's ({run}:<step>)")
        with self.lock:
            if self.step is not None and parsed.step <= self.step:
                raise PushRefused(
                    f"weights version {version} is not newer than the last push ({WeightsVersion(run, self.step)})"
                )
        return parsed.step

    def accept(self, run: str, step: int) -> None:
        """Record an accepted push of ``run`` at ``step`` (checked again: two pushes may have raced)."""
        with self.lock:
            if self.owner != run or (self.step is not None and step <= self.step):
                raise PushRefused(
                    f"weights version {WeightsVersion(run, step)} was overtaken by {self.owner}:{self.step}"
                )
            self.step = step


def read_token(path: str | os.PathLike) -> str:
    """The token in the file ``path`` (surrounding blanks dropped); ``ConfigError`` naming the file (never its
    content) when it cannot be read or is empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(str(path), f"cannot read the server token ({err.strerror or err})") from None
    if not token:
        raise ConfigError(str(path), "the server token file is empty")
    return token


def server_token(host: str, token_file: str | None) -> tuple[str, bool]:
    """The server's token and whether it was generated here (to be written by ``write_token``): from
    ``TOKEN_ENV``, else ``token_file``, else new when ``host`` is loopback; a ``ConfigError`` otherwise."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV], False
    if token_file:
        return read_token(token_file), False
    if not is_loopback(host):
        raise ConfigError(
            f"--host {host}",
            f"a server other machines can reach needs a token: set {TOKEN_ENV} or --token_file (the same on the "
            "trainer: the variable or generation.vllm.server_token_file); docs/vllm.md, Server mode",
        )
    return secrets.token_urlsafe(32), True


def write_token(token: str, port: int) -> Path:
    """Write ``token`` to ``wire.token_path(port)``, readable by this user only (``auth.write_token``)."""
    return auth.write_token(token_path(port), token)


def no_tensors(header: dict[str, Any], entries: list[Entry]) -> None:
    """``read_frame`` check for a frame that carries no tensors (a handshake, a control request)."""
    if entries:
        raise FrameError(f"{header['op']!r} frames carry no tensors ({len(entries)} declared)")
