"""A stand-in generation server for the fleet's tests and ``benchmarks/fleet.py``: an in-process ``Replica`` that
answers after a fixed time per generated token (one request at a time, like a server whose batch is its whole
capacity) with tokens that are a function of the prompt and its seed only (prompt ``i`` of a request seeded ``s``
draws sample ``j`` with seed ``s + i * n + j``, the rule the fleet relies on), each token tagged with the version
the stand-in holds. ``kill`` makes every call raise ``ReplicaDown`` (the ones in flight too) and forgets the
weights; ``restart`` brings it back empty, as a restarted server."""

from __future__ import annotations

import threading
import time

import torch

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampledTokens
from aitraining_pl.generation.servers.replica import PushReport, ReplicaDown, ReplicaStats
from aitraining_pl.generation.version import WeightsVersion


def tokens_for(prompt: list[int], seed: int, length: int, vocab: int) -> list[int]:
    """The stand-in's response to ``prompt`` under ``seed`` (ids 1 .. vocab - 1)."""
    generator = torch.Generator().manual_seed(int(seed) * 7919 + sum((i + 1) * t for i, t in enumerate(prompt)))
    return torch.randint(1, vocab, (length,), generator=generator).tolist()


class StandInReplica:
    """See the module docstring. ``token_seconds``: seconds per generated token (rows x ``max_new_tokens``);
    ``push_seconds_per_gb``: time a push takes per GB of weights."""

    def __init__(self, url: str = "standin://0", token_seconds: float = 0.0, vocab: int = 50, push_seconds_per_gb=0.0):
        self.url, self.token_seconds, self.vocab, self.push_rate = url, token_seconds, vocab, push_seconds_per_gb
        self.stats = ReplicaStats()
        self.version: WeightsVersion | None = None
        self.killed = False
        self.paused = threading.Event()
        self.busy = threading.Lock()  #: one request at a time
        self.served: list[tuple[int, WeightsVersion | None]] = []  #: (prompts, version asked) of each answer
        self.prompts: list[list[int]] = []  #: every prompt answered
        self.pushes: list[WeightsVersion] = []
        self.pushed: list[list[str]] = []  #: the names of each push
        self.events: list[str] = []  #: "pause", "push", "resume", in order
        self.outstanding = 0

    def _wait(self, seconds: float, deadline: float) -> None:
        end = time.monotonic() + seconds
        while True:
            if self.killed:
                raise ReplicaDown(f"{self.url}: connection refused")
            now = time.monotonic()
            if now >= deadline:
                raise ReplicaDown(f"{self.url}: no answer by its deadline")
            if now >= end and not self.paused.is_set():
                return
            time.sleep(min(0.005, max(0.0, end - now)) or 0.001)

    def sample(self, request, deadline: float) -> SampledTokens:
        if self.killed:
            raise ReplicaDown(f"{self.url}: connection refused")
        wanted = request.version
        if wanted is not None and (self.version is None or not self.version.serves(wanted, request.newer)):
            raise GenerationServerError(self.url, f"asked for version {wanted}, holds {self.version}")
        n, length = int(request.num_samples), int(request.generation.max_new_tokens)
        prompts = [row[m.bool()].tolist() for row, m in zip(request.prompt_ids, request.prompt_mask)]
        self.outstanding += len(prompts) * n * length
        try:
            with self.busy:
                self._wait(self.token_seconds * len(prompts) * n * length, deadline)
                version = self.version
        finally:
            self.outstanding -= len(prompts) * n * length
        rows = [
            tokens_for(p, request.seed + i * n + j, length, self.vocab) for i, p in enumerate(prompts) for j in range(n)
        ]
        ids = torch.tensor(rows, dtype=torch.long).view(len(rows), length)
        self.served.append((len(prompts), wanted))
        self.prompts += prompts
        step = -1 if version is None else version.step
        return SampledTokens(ids, sampling_logprobs=torch.full(ids.shape, -1.0),
                             token_versions=torch.full(ids.shape, step, dtype=torch.long))  # fmt: skip

    def outstanding_tokens(self) -> int:
        return self.outstanding

    def push(self, weights, version: WeightsVersion) -> PushReport:
        if self.killed:
            raise ReplicaDown(f"{self.url}: connection refused")
        start = time.perf_counter()
        size = sum(t.numel() * t.element_size() for _, t in weights)
        self.pushed.append([name for name, _ in weights])
        time.sleep(self.push_rate * size / 1e9)
        self.events.append("push")
        self.version = version
        self.pushes.append(version)
        return PushReport(time.perf_counter() - start, size)

    def pause(self) -> None:
        self.events.append("pause")
        self.paused.set()

    def resume(self) -> None:
        self.events.append("resume")
        self.paused.clear()

    def alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed, self.version = True, None

    def restart(self) -> None:
        self.killed = False

    def close(self) -> None:
        pass
