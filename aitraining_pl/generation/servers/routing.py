"""How a fleet (``generation.servers.fleet``) splits a rollout over its servers and puts it back together: what one
server is asked (``ReplicaRequest``: a run of consecutive prompts, seeded as they are in the whole, and the version
that must sample them), which server an episode's next turn goes to (``PrefixAffinity``), the answers joined in the
prompts' order, and what the fleet knows of each server (``Member``: its version, its load in outstanding tokens,
its counters), and the gate between its rollouts and a push (``Gate``)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from aitraining_pl.generation.backend import SampledTokens, SampleRequest
from aitraining_pl.generation.servers.replica import Replica
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.routing_replay import RouteShape


@dataclasses.dataclass
class ReplicaRequest(SampleRequest):
    """What one server is asked: a ``sample`` call's arguments for a run of its prompts (on the CPU; prompt ``i``
    drawn with ``seed + i * num_samples``), and the weights that must sample them (``version``; with ``newer`` that
    version or a later one of the run)."""

    version: WeightsVersion | None = None
    newer: bool = False
    vocab: int | None = None  #: the policy's head rows, when known: every answered token id is below it
    #: an MoE policy's ``RouteShape`` when its routes are asked for (routing replay), else None
    routes: RouteShape | None = None

    @classmethod
    def of(
        cls, request: SampleRequest, version: WeightsVersion | None, newer: bool = False, **changes
    ) -> ReplicaRequest:
        """``request`` (with ``changes``) to be sampled by ``version`` (with ``newer``: or a later one)."""
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(SampleRequest)}
        return cls(**{**fields, **changes}, version=version, newer=newer)

    @property
    def tokens(self) -> int:
        """Tokens asked for: responses times ``max_new_tokens``."""
        return int(self.prompt_ids.shape[0]) * int(self.num_samples) * int(self.generation.max_new_tokens)


#: the shortest recorded prompt a later prompt is routed by: one block of vLLM's prefix cache (16 tokens, its
#: default ``--block-size``); a shorter shared prefix saves no cached block and would only pin prompts to one server
MIN_PREFIX_TOKENS = 16


class PrefixAffinity:
    """Which server served each recent prompt, found again for a later prompt that strictly extends it (an
    episode's next turn); a repeated prompt is not a continuation and is routed by load, and so is one whose longest
    recorded prefix is shorter than ``min_tokens`` (``MIN_PREFIX_TOKENS``). Keys are rolling hashes of the prompt's
    tokens; the oldest of ``capacity`` entries are forgotten."""

    MOD, BASE = (1 << 61) - 1, 1_000_003

    def __init__(self, capacity: int = 65536, min_tokens: int = MIN_PREFIX_TOKENS):
        self.capacity, self.table, self.lock = capacity, OrderedDict(), threading.Lock()
        self.min_tokens = max(1, int(min_tokens))

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        out, h = [], 0
        for token in tokens:
            h = (h * self.BASE + int(token) + 1) % self.MOD
            out.append(h)
        return out

    def record(self, tokens: Sequence[int], index: int) -> None:
        if not tokens:
            return
        key = (len(tokens), self.hashes(tokens)[-1])
        with self.lock:
            self.table[key] = index
            self.table.move_to_end(key)
            while len(self.table) > self.capacity:
                self.table.popitem(last=False)

    def lookup(self, tokens: Sequence[int]) -> int | None:
        """The server of the longest recorded prompt of at least ``min_tokens`` that ``tokens`` strictly extends, or
        None."""
        hashes = self.hashes(tokens)
        with self.lock:
            for length in range(len(tokens) - 1, self.min_tokens - 1, -1):
                index = self.table.get((length, hashes[length - 1]))
                if index is not None:
                    return index
        return None


def part(request: ReplicaRequest, start: int, stop: int) -> ReplicaRequest:
    """Prompts ``start .. stop`` of ``request`` (common left padding dropped), seeded as they are in it."""
    mask = request.prompt_mask[start:stop]
    width = max(1, int(mask.sum(1).max())) if mask.numel() else 1
    seed = None if request.seed is None else (request.seed + start * request.num_samples) % 2**31
    ids = request.prompt_ids[start:stop, -width:]
    images = None if request.images is None else request.images.part(start, stop)
    return dataclasses.replace(request, prompt_ids=ids, prompt_mask=mask[:, -width:], seed=seed, images=images)


def joined(parts: list[SampledTokens], pad: int, device: torch.device, prompt_width: int = 0) -> SampledTokens:
    """The answers of consecutive runs of prompts as one, right padded to the longest response; their routes (each
    run's prompts without their common left padding: ``part``) left padded to ``prompt_width`` too."""
    width = max(p.response_ids.shape[1] for p in parts)
    routes = None
    if all(p.routes is not None for p in parts):
        pads = [(prompt_width - (p.routes.shape[1] - p.response_ids.shape[1]), width - p.response_ids.shape[1])
                for p in parts]  # fmt: skip
        routes = torch.cat([torch.nn.functional.pad(p.routes, (0, 0, 0, 0, *pad), value=-1).to(device)
                            for p, pad in zip(parts, pads)])  # fmt: skip

    def cat(tensors: list[torch.Tensor | None], value: float) -> torch.Tensor | None:
        if any(t is None for t in tensors):
            return None
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors]
        return torch.cat(padded).to(device)

    return SampledTokens(
        cat([p.response_ids for p in parts], pad),
        sampling_logprobs=cat([p.sampling_logprobs for p in parts], 0.0),
        token_versions=cat([p.token_versions for p in parts], -1),
        routes=routes,
    )


class Member:
    """One server of the fleet and what the fleet knows of it (its counters since the last ``stats``)."""

    def __init__(self, index: int, replica: Replica):
        self.index, self.replica, self.up = index, replica, True
        self.error: BaseException | None = None  #: why it was last marked down
        self.version: WeightsVersion | None = None  #: the weights it holds (pushed by this fleet)
        self.base_pushed = False  #: it holds a LoRA policy's base weights (its adapter then travels alone)
        self.outstanding = 0  #: tokens asked for and not answered
        self.running, self.busy_since = 0, 0.0
        self.requests = self.tokens = self.push_bytes = 0
        self.busy = self.push_seconds = 0.0

    def enter(self, tokens: int) -> None:
        self.outstanding += tokens
        self.running += 1
        if self.running == 1:
            self.busy_since = time.perf_counter()

    def leave(self, tokens: int) -> None:
        self.outstanding -= tokens
        self.running -= 1
        if self.running == 0:
            self.busy += time.perf_counter() - self.busy_since

    def busy_seconds(self) -> float:
        """Busy time since the last ``stats`` (the running stretch up to now included; restarted)."""
        now, busy = time.perf_counter(), self.busy
        if self.running:
            busy, self.busy_since = busy + now - self.busy_since, now
        self.busy = 0.0
        return busy


class Gate:
    """A fleet's rollouts in flight (many at once) against a push that is not in flight (alone, once they are
    answered)."""

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
