"""``Replica``: what the fleet (``generation.servers.fleet``) asks of one generation server's client.

One replica is one server URL (a ``vllm serve``, a data-parallel ``vllm serve`` or a ``vllm-router`` that balance
themselves, or this project's HF server). The fleet sends each request to the replica with the fewest outstanding
tokens, keeps one episode's calls on one replica, and brings every weights version to every replica before any
request names it. A replica's calls raise ``ReplicaDown`` when the server cannot be reached (nothing listening, a
dropped connection, a deadline passed), so the fleet re-sends its requests elsewhere; any other refusal (a bad
push, a bad request) is a ``GenerationServerError`` that ends the run with one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from aitraining_pl.generation.backend import SampledTokens
from aitraining_pl.generation.version import WeightsVersion


class ReplicaDown(ConnectionError):
    """The server behind a replica cannot be reached (its requests may be re-sent to another replica)."""


@dataclass
class PushReport:
    """What one push to one replica cost."""

    seconds: float
    bytes: int


@dataclass
class ReplicaStats:
    """Per-server counters the fleet logs (``train/fleet/<index>/...``)."""

    requests: int = 0
    tokens: int = 0  #: generated tokens answered
    busy_seconds: float = 0.0  #: wall time with at least one request outstanding
    pushes: list[PushReport] = field(default_factory=list)


@runtime_checkable
class Replica(Protocol):
    """One server's client. Thread-safe: the fleet calls ``sample`` from several threads at once."""

    url: str
    stats: ReplicaStats

    def sample(self, request, deadline: float) -> SampledTokens:
        """The samples of one ``SampleRequest`` (its ``num_samples`` per prompt, rows in ``repeat_interleave``
        order) by weights that serve ``request``'s version; ``deadline`` is a ``time.monotonic()`` time."""
        ...

    def outstanding_tokens(self) -> int:
        """Tokens this client has asked for and not yet been answered (the router's load measure)."""
        ...

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: WeightsVersion) -> PushReport:
        """Make ``weights`` (name, tensor) of ``version`` the served ones; a refused push leaves the previous
        weights serving."""
        ...

    def pause(self) -> None:
        """Hold generation between decode steps, keeping the KV cache (vLLM's ``/pause?mode=keep``)."""
        ...

    def resume(self) -> None:
        """Go on generating after ``pause``."""
        ...

    def alive(self) -> bool:
        """Whether the server answers its health route now (a restarted server rejoins at the next push)."""
        ...

    def close(self) -> None:
        """Release the connection (not the server)."""
        ...
