"""The generation server's sample requests between their arrival and their answer (``tcp_server``, whose
module docstring describes the protocol): the queue, the batches that serve it, which weights version may serve
which request, and the order of a weight load against the other ranks' requests.

**Versions.** A request names the version it needs (``run:step``); by default only that version serves it. With
``newer`` any held version of the same run whose step is at least the requested one does (an asynchronous trainer
that bounds staleness from below). ``token_versions`` of each answer say which step sampled each token.

**Batching.** Each request joins ``pending``; a handler that finds the engine free waits until every open trainer
connection of the owner's run has a request queued (at most ``batch_wait``), then serves every queued request the
held weights may serve in one ``sample_many``. The server's lock (``changed``) is held from taking the batch to its
answers, as during a weight load.

**The load gate** (pipelined loads, several ranks). A load that is not in flight waits, at most ``timeout``,
until no trainer connection of another rank of the run still has its latest ``sample`` request at the held
step: every other rank has asked for a newer version, has never sampled, or has closed. A rank whose rollout of
step ``s`` is queued (or about to be asked for again, as the turns of an episode are) is then never left without
weights ``s``. In the synchronous loop the other ranks ask for the new version right after the push (they wait
for it), so the gate opens at once; with one rank it never waits.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from aitraining_pl.generation.backend import SampledTokens, SampleRequest
from aitraining_pl.generation.servers.tcp_guards import Ownership
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.loading import one_line


@dataclasses.dataclass
class Seat:
    """A trainer connection of a run, as batching and the load gate see it."""

    run: str
    rank: int
    latest: int | None = None  #: the step its latest ``sample`` request asked for (None: none yet, or any)


class Job:
    """One connection's ``sample`` request, queued until a batch serves it."""

    def __init__(self, version: Any, newer: bool, request: SampleRequest):
        self.version, self.newer, self.request = version, newer, request  #: the version it needs; ``sample``'s args
        self.sampled: SampledTokens | None = None  #: its rows, once served
        self.error: str | None = None  #: or why it could not be
        self.batched = self.cached_tokens = 0  #: requests in the ``generate`` that served it; its cached tokens
        self.served_by: Any = None  #: the version held when its batch started


class SampleQueue:
    """The pending ``sample`` requests of a server and the batches that serve them (see the module docstring).

    Args:
        engine: the server's engine (``version``, ``sample_many``, ``cached_each``).
        ownership: the server's owner run (whose connections a batch waits for).
        changed: the server's lock and condition (held while the engine works).
        batch_wait: seconds a batch waits for every trainer connection to have a request queued.
        timeout: the longest a load waits at the gate (the server's ``--timeout``).
        log: the server's log.
    """

    def __init__(
        self,
        engine: Any,
        ownership: Ownership,
        changed: threading.Condition,
        batch_wait: float,
        timeout: float,
        log: Callable[[str], None],
    ):
        self.engine, self.ownership, self.changed = engine, ownership, changed
        self.batch_wait, self.timeout, self.log = batch_wait, timeout, log
        self.pending: list[Job] = []  #: requests not served yet (under ``changed``)
        self.gathering = False  #: a handler is gathering a batch (under ``changed``)
        self.seats: dict[int, Seat] = {}  #: the trainer connections, by connection id

    # ------------------------------------------------------------------ connections
    def members(self) -> int:
        """The owner's open trainer connections (a batch waits for each to have a request queued)."""
        owner = self.ownership.owner
        return sum(1 for seat in list(self.seats.values()) if seat.run == owner)

    def wake(self) -> None:
        """Notify the waiters of ``changed`` from another thread (the caller must not wait for a running batch)."""

        def notify() -> None:
            with self.changed:
                self.changed.notify_all()

        threading.Thread(target=notify, daemon=True).start()

    # ------------------------------------------------------------------ requests
    def holds(self, job: Job) -> bool:
        """Whether the engine holds weights that may serve ``job`` (not during a load): the version it names (None:
        any), or one that ``WeightsVersion.serves`` it (``newer``); a version that is no ``run:step`` (a teacher's
        fixed weights) serves only itself."""
        held = self.engine.version
        if held is None or job.version is None or held == job.version:
            return held is not None
        have, want = WeightsVersion.parse(held), WeightsVersion.parse(job.version)
        return have is not None and want is not None and have.serves(want, job.newer)

    def serve(self, job: Job, timeout: float, seat: Seat | None) -> str | None:
        """Queue ``job`` and wait until a batch has served it (its ``sampled`` or ``error``); the refusal's message
        when its weights did not arrive within ``timeout`` seconds. ``seat``: the asking connection's (its latest
        step is recorded before the lock is taken, so a load at the gate counts it at once)."""
        if seat is not None:
            seat.latest = None if job.version is None else getattr(WeightsVersion.parse(job.version), "step", 0)
        deadline = time.monotonic() + timeout
        with self.changed:
            self.pending.append(job)
            self.changed.notify_all()  # a gathering batch counts it; a load at the gate sees the seat move
            while job.sampled is None and job.error is None:
                if self.holds(job) and not self.gathering:
                    self.serve_batch()
                    continue
                left = deadline - time.monotonic()
                if left <= 0 and not self.holds(job):
                    self.pending.remove(job)
                    held = self.engine.version or "none"
                    wanted = f"{job.version} (or newer)" if job.newer else job.version
                    return f"weights {wanted} did not arrive within {timeout:g} s (held: {held})"
                self.changed.wait(left if left > 0 else None)  # held and gathering: that batch takes it
        return None

    def serve_batch(self) -> None:
        """With ``changed`` held: wait until every trainer connection has a request queued (at most
        ``batch_wait``), then serve the queued requests the held weights may serve in one ``generate``."""
        self.gathering = True
        try:
            self.changed.wait_for(lambda: len(self.pending) >= self.members(), self.batch_wait)
            batch = [job for job in self.pending if self.holds(job)]  # a load may have come meanwhile
            self.pending = [job for job in self.pending if job not in batch]
            self.generate(batch)
        finally:
            self.gathering = False
            self.changed.notify_all()

    def generate(self, batch: list[Job]) -> None:
        """Serve ``batch`` in one ``sample_many``; if it fails, each of its requests alone (its own error). An
        engine that gives no ``token_versions`` sampled every token with the weights held at the start."""
        if not batch:
            return
        version = self.engine.version
        step = getattr(WeightsVersion.parse(version), "step", 0)  # 0: a teacher's fixed weights
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
            if rows.token_versions is None:
                rows = rows._replace(token_versions=torch.full_like(rows.response_ids, step))
            job.sampled, job.batched, job.cached_tokens, job.served_by = rows, len(batch), cached, version

    # ------------------------------------------------------------------ loads
    def wait_for_ranks(self, run: str, rank: int) -> None:
        """With ``changed`` held, before a load that is not in flight: wait (at most ``timeout``) until no trainer
        connection of another rank of ``run`` has its latest request at the held step (the module docstring)."""

        def behind() -> list[int]:
            held = WeightsVersion.parse(self.engine.version)
            if held is None or held.run != run:
                return []
            seats = list(self.seats.values())
            return sorted({s.rank for s in seats if s.run == run and s.rank != rank and s.latest == held.step})

        if behind() and not self.changed.wait_for(lambda: not behind(), self.timeout):
            ranks = ", ".join(map(str, behind()))
            self.log(
                f"rank(s) {ranks} still at weights {self.engine.version} after {self.timeout:g} s (--timeout); "
                "loading the push anyway"
            )
