"""``Fleet``: the generation backend of server mode (``location = "server"``, ``sample``, ``sync``, ``push``, ``sleep``,
``close``) over N generation servers (``Replica``\\ s): a single URL is a fleet of one (``generation.server:
connect`` / ``launch`` / a URL: one ``vllm serve``, a data-parallel ``vllm serve`` or a ``vllm-router`` that balance
themselves, or this project's HF server), ``urls`` or ``launch: {count: N}`` a fleet of N. The rollout engine and the
asynchronous pipeline use one server or many alike.

**Connecting** (``connect``; ``from_context`` for the registry's ``<engine>-server``): each URL gets an
``HTTPReplica`` with the run's token (``auth.find_token``); a server another machine can reach must require it
(``auth.check_guarded``: one that answers without it is refused unless ``generation.vllm.allow_unauthenticated``).

**Routing.** A ``sample`` call's prompts are split into runs of consecutive prompts, each sent to one server: a
prompt that continues one served before (the next turn of a multi-turn episode, an agent's next call: its tokens
start with that earlier prompt) goes where that one went, so the server's prefix cache holds its earlier turns;
the others go to the servers with the fewest outstanding tokens (asked for, not yet answered), filling the least
loaded first. The answers are put back in the prompts' order. Prompt ``i`` of a call seeded ``s`` is drawn with
seed ``s + i * num_samples`` (vLLM's rule for a request's prompts): a run starting at prompt ``k`` is sent with
seed ``s + k * num_samples``, so the samples do not depend on which server drew which prompt.

**Versions.** A push goes to every server (in parallel) before the fleet's version moves, so no request names a
version some server lacks; a request goes only to a server holding its version (the free schedule's ``newer``:
that version or a later one), so ``max_staleness`` holds across the fleet. An in-flight push (``async_schedule:
free``) pauses each server between decode steps keeping its KV cache, pushes, and resumes it.

**Pushes and rollouts.** A push that is not ``in_flight`` waits until the rollouts already being sampled are
answered (each is sampled by the version it named); rank 0 pushes, the other ranks record the version.

**Faults.** A server that cannot be reached, or does not answer by its deadline (``connect_timeout`` plus
``token_timeout`` per ``max_new_tokens``: a slow server does not hold up the others), is marked down with one
warning; its requests are re-sent to the servers up (the same seed: the same samples from a deterministic
server) and ``fleet/servers_up`` drops. At each push a server marked down is asked its health route and, when it
answers, gets the push and rejoins. With none up (a fleet of one: its server down, nowhere else to send the
request), the call fails with one ``GenerationServerError`` line naming the servers, what was being done and why.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampledTokens, SampleRequest
from aitraining_pl.generation.servers.adapters import adapter_weights, supported
from aitraining_pl.generation.servers.answers import vocab_of
from aitraining_pl.generation.servers.auth import check_guarded, find_token
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.replica import PushReport, Replica, ReplicaDown
from aitraining_pl.generation.servers.routing import Gate, Member, PrefixAffinity, ReplicaRequest, joined, part
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.models.lora import is_peft_model, plain_weights
from aitraining_pl.models.routing_replay import RouteShape, route_shape
from aitraining_pl.models.sharding import is_sharded
from aitraining_pl.models.weights import policy_weights

RESUME = "a run that had started resumes from its last checkpoint with --ckpt_path"
#: seeds drawn for unseeded calls are offset by this per rank (every rank's global generator is the same)
RANK_SEED_STRIDE = 1_000_003


class Fleet:
    """The generation backend over ``replicas`` (see the module docstring).

    Args:
        replicas: the servers' clients, in the order of their URLs (metrics are ``fleet/<index>/...``).
        weights: the policy's ``(name, tensor)`` pairs for ``sync`` (``policy_weights``).
        rank: this process's global rank; rank 0 pushes (the others record the version their rollouts need).
        run: the run's id (shared by its ranks): versions are ``WeightsVersion(run, step)``.
        connect_timeout: seconds a request may take beyond its generation time (connecting, queueing).
        token_timeout: seconds per ``max_new_tokens`` a request may take, on top of ``connect_timeout``.
        sync_weights: False: push only once (debugging).
    """

    location = "server"  #: a ``GenerationBackend`` in other processes
    kind = "generation fleet"

    @classmethod
    def from_context(cls, generation: Any, context: Any) -> Fleet:
        """The fleet of the running servers ``generation.server`` names (``GenerationConfig.fleet``) for a
        ``BackendContext`` (``registry.BACKENDS``' ``<engine>-server``). Servers to launch are started first
        (``launcher.LaunchedFleet``), then ``connect`` is given their endpoints."""
        servers = generation.fleet()
        if servers is None or not servers.urls:
            raise ValueError("Fleet.from_context needs running servers (urls); launched ones go through connect")
        return cls.connect(servers, [(url, None) for url in servers.urls], generation, context)

    @classmethod
    def connect(cls, servers: Any, endpoints: Sequence[tuple[str, str | None]], generation: Any, context: Any) -> Fleet:
        """The fleet of ``endpoints`` (``(url, token file or None)``, one per server) for ``generation.server``'s
        ``servers`` (a ``ServerConfig``: the timeouts) and a ``BackendContext``: an ``HTTPReplica`` of each URL with
        the run's token (the token file, else ``generation.vllm``'s, else ``AITRAINING_PL_SERVER_TOKEN``), checked
        (``auth.check_guarded``)."""
        options, replicas = generation.vllm, []
        try:
            for url, token_file in endpoints:
                given = dataclasses.replace(options, server_token_file=token_file) if token_file else options
                replicas.append(HTTPReplica(url, find_token(given), timeout=options.server_timeout))
                check_guarded(replicas[-1].url, bool(options.allow_unauthenticated))
        except BaseException:
            for replica in replicas:
                replica.close()
            raise
        return cls(replicas, policy_weights, context.rank, context.run, float(servers.connect_timeout),
                   float(servers.token_timeout), bool(options.sync_weights))  # fmt: skip

    def __init__(
        self,
        replicas: Sequence[Replica],
        weights: Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]],
        rank: int = 0,
        run: str | None = None,
        connect_timeout: float = 30.0,
        token_timeout: float = 1.0,
        sync_weights: bool = True,
    ):
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.members = [Member(i, r) for i, r in enumerate(replicas)]
        self.weights, self.rank, self.run = weights, int(rank), run or uuid.uuid4().hex
        self.connect_timeout, self.token_timeout, self.sync_weights = connect_timeout, token_timeout, sync_weights
        self.at_least = False  #: requests take their version or any later one (the free schedule)
        self._version: WeightsVersion | None = None
        self.calls = itertools.count()
        self.lock = threading.Lock()  #: guards the members' state
        self.affinity = PrefixAffinity()
        self.sampling = concurrent.futures.ThreadPoolExecutor(4 * len(replicas), thread_name_prefix="fleet-sample")
        self.pushing = concurrent.futures.ThreadPoolExecutor(len(replicas), thread_name_prefix="fleet-push")
        self.sync_seconds = 0.0  #: wall time of the last push (all servers)
        self.cached_tokens = 0  #: prompt tokens of the last ``sample`` found in the servers' prefix caches
        self.gate = Gate()  #: a push that is not in flight waits for the rollouts being sampled
        self.vocab: int | None = None  #: the policy's head rows (``sync``): answers' token ids are checked below it
        #: an MoE policy's ``RouteShape`` (``sync``): its routes are asked for and checked against it
        self.route_shape: RouteShape | None = None

    @property
    def version(self) -> WeightsVersion | None:
        """The weights version this process's requests name (set as ``WeightsVersion`` or ``run:step`` text)."""
        return self._version

    @version.setter
    def version(self, value: Any) -> None:
        self._version = WeightsVersion.parse(value)

    def urls(self) -> str:
        return ", ".join(m.replica.url for m in self.members)

    def up(self) -> int:
        return sum(m.up for m in self.members)

    def gone(self, doing: str) -> GenerationServerError:
        """The one line for a fleet with no server left; a fleet of one names its server and why it is down."""
        if len(self.members) == 1:
            url, why = self.members[0].replica.url, self.members[0].error
            what = str(why).removeprefix(f"{url}: ") if why is not None else f"down or unreachable while {doing}"
            return GenerationServerError(f"generation server {url}", f"{what}; start it again; {RESUME}")
        return GenerationServerError(
            self.kind,
            f"all {len(self.members)} generation servers ({self.urls()}) are down or unreachable while {doing}; "
            f"start them again; {RESUME}",
        )

    def _down(self, member: Member, err: BaseException, doing: str) -> None:
        with self.lock:
            was, member.up, member.error = member.up, False, err
            member.base_pushed = False  # a restarted server holds no base weights
            up = self.up()
        if was and len(self.members) > 1:  # a fleet of one: the error line says it (nowhere else to send)
            warnings.warn(
                f"generation fleet: server {member.index} ({member.replica.url}) is down while {doing} ({err}); "
                f"its requests go to the others ({up} of {len(self.members)} up; it rejoins at a push once it answers)",
                RuntimeWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ sampling
    def _serving(self, version: WeightsVersion | None, newer: bool) -> list[Member]:
        """The servers up that may take a request for ``version``: on rank 0, those it pushed it to; on another rank
        (which may not have walked the push: the asynchronous pipeline pushes from rank 0 only) every server up, which
        holds the request until rank 0's push of ``version`` arrives (``Replica.sample``)."""
        with self.lock:
            return [m for m in self.members if m.up and (self.rank != 0 or _serves(m, version, newer))]

    def plan(self, prompts: list[list[int]], request: ReplicaRequest) -> list[int]:
        """The member index for each prompt: the one whose earlier prompt it continues (``PrefixAffinity``) while
        that one holds less than a fair share (this call's prompts over the servers) more than the least loaded, else
        by load."""
        members = self._serving(request.version, request.newer)
        if not members:
            raise self.gone(f"sampling with the weights of step {_step(request.version)}")
        cost = int(request.num_samples) * int(request.generation.max_new_tokens)
        load = {m.index: m.outstanding for m in members}
        assigned: list[int | None] = [None] * len(prompts)
        share = cost * -(-len(prompts) // len(members))  # load still weighs: a shared prefix pins no more than this
        for i, tokens in enumerate(prompts):
            index = self.affinity.lookup(tokens)
            if index in load and load[index] - min(load.values()) < share:
                assigned[i] = index
                load[index] += cost
        free = [i for i, a in enumerate(assigned) if a is None]
        counts = dict.fromkeys(load, 0)
        for _ in free:  # fill the least loaded first
            index = min(load, key=lambda k: (load[k], k))
            load[index] += cost
            counts[index] += 1
        order = iter(free)
        for index, count in counts.items():
            for _ in range(count):
                assigned[next(order)] = index
        return assigned  # type: ignore[return-value]

    def sample(self, request: SampleRequest) -> SampledTokens:
        """``request.num_samples`` responses per left-padded prompt from the fleet (rows in ``repeat_interleave``
        order), by weights of this process's version; ``seed`` None: drawn from torch's global generator."""
        seed = request.seed
        if seed is None:
            seed = (int(torch.randint(0, 2**31, (1,))) + self.rank * RANK_SEED_STRIDE) % 2**31
        device, pad_token_id = request.prompt_ids.device, int(request.pad_token_id)
        request = ReplicaRequest.of(
            request, self.version, bool(self.at_least), prompt_ids=request.prompt_ids.cpu(),
            prompt_mask=request.prompt_mask.cpu(), end_ids=list(request.end_ids), pad_token_id=pad_token_id,
            num_samples=int(request.num_samples), seed=int(seed), vocab=self.vocab,
            routes=self.route_shape if getattr(request.generation, "routing_replay", False) else None,
        )  # fmt: skip
        prompts = [row[m.bool()].tolist() for row, m in zip(request.prompt_ids, request.prompt_mask)]
        with self.gate.sample():
            assigned = self.plan(prompts, request)
            runs = [(k, len(list(g))) for k, g in itertools.groupby(assigned)]
            futures, start = [], 0
            for index, length in runs:
                piece = part(request, start, start + length)
                futures.append(self.sampling.submit(self._serve, piece, self.members[index]))
                start += length
            answers = [f.result() for f in futures]
        served = [index for (member, _), (_, length) in zip(answers, runs) for index in [member.index] * length]
        for tokens, index in zip(prompts, served):
            self.affinity.record(tokens, index)
        self.cached_tokens = sum(int(getattr(m.replica, "cached_tokens", 0) or 0) for m, _ in answers)
        return joined([out for _, out in answers], pad_token_id, device, int(request.prompt_ids.shape[1]))

    def _serve(self, request: ReplicaRequest, member: Member) -> tuple[Member, SampledTokens]:
        """``request`` on ``member``, re-sent to the least loaded server up while the one asked is down."""
        while True:
            try:
                return member, self._call(member, request)
            except ReplicaDown as err:
                self._down(member, err, f"sampling {request.tokens} tokens")
                members = self._serving(request.version, request.newer)
                if not members:
                    raise self.gone(f"sampling with the weights of step {_step(request.version)}") from None
                member = min(members, key=lambda m: (m.outstanding, m.index))

    def _call(self, member: Member, request: ReplicaRequest) -> SampledTokens:
        tokens = request.tokens
        deadline = time.monotonic() + self.connect_timeout + self.token_timeout * int(request.generation.max_new_tokens)
        with self.lock:
            member.enter(tokens)
        try:
            out = member.replica.sample(request, deadline)
        finally:
            with self.lock:
                member.leave(tokens)
        versions = out.token_versions
        answered = int((versions >= 0).sum()) if versions is not None else int(out.response_ids.numel())
        with self.lock:
            member.requests += 1
            member.tokens += answered
        return out

    # ------------------------------------------------------------------ weights
    def sync(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """Rank 0: push ``policy``'s weights as ``version`` unless the fleet holds it; the other ranks record it
        (under FSDP2 they walk the gathers with rank 0). A LoRA policy whose adapter travels alone
        (``adapters.supported``) pushes its unmerged base weights once to each server (again to one that rejoins),
        then its adapter alone. Returns whether the weights changed."""
        self.vocab, self.route_shape = vocab_of(policy), route_shape(policy)
        if is_peft_model(policy) and not is_sharded(policy) and supported(policy):
            if self.rank != 0:
                return self.push(iter(()), version)
            return self.push(adapter_weights(policy), version, base=lambda: list(plain_weights(policy, merged=False)))
        walk = self.rank == 0 or is_sharded(policy)
        return self.push(self.weights(policy) if walk else iter(()), version)

    @torch.no_grad()
    def push(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: Any = None, in_flight: bool = False, base=None
    ) -> bool:
        """Push ``weights`` as ``version`` (the optimizer step; None: a fresh one) to every server up, and to each
        server marked down that answers its health route (it rejoins), in parallel; the fleet's requests name
        ``version`` only once every server up holds it. ``in_flight``: pause each server (keeping its KV cache),
        push, resume. ``base``: ``weights`` are an adapter, and ``base()`` the weights under it, pushed first to a
        server that has not had them. Returns whether the weights changed."""
        key = WeightsVersion(self.run, next(self.calls) if version is None else int(version))
        if self._version is not None and (key == self._version or not self.sync_weights):
            return False
        with self.lock:
            down = [m for m in self.members if not m.up]
        back = [m for m in down if _answers(m.replica)]
        targets = [m for m in self.members if m.up] + back
        start = time.perf_counter()
        if self.rank != 0:  # rank 0 pushes to the same servers; they hold this rank's requests until they have it
            for _ in weights:
                pass
            for member in targets:
                member.version, member.up = key, True
        else:
            weights = list(weights) if iter(weights) is weights else weights  # a stream, read once per server
            bare = [m for m in targets if not m.base_pushed]
            under = base() if base is not None and bare else None
            with self.gate.push() if not in_flight else contextlib.nullcontext():
                list(self.pushing.map(lambda m: self._push_one(m, weights, key, in_flight, under), targets))
        for member in back:
            if member.up and self.rank == 0:
                warnings.warn(
                    f"generation fleet: server {member.index} ({member.replica.url}) answers again and rejoined at "
                    f"step {key.step} ({self.up()} of {len(self.members)} up)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if not any(m.up and m.version == key for m in self.members):
            raise self.gone(f"pushing the weights of step {key.step}")
        self.sync_seconds = time.perf_counter() - start
        self._version = key
        return True

    def _push_one(self, member: Member, weights: Any, key: WeightsVersion, in_flight: bool, base=None) -> None:
        replica, paused, seconds, size = member.replica, False, 0.0, 0
        try:
            if in_flight:
                replica.pause()
                paused = True
            if base is not None and not member.base_pushed:
                first = replica.push(base, key)
                seconds, size, member.base_pushed = first.seconds, first.bytes, True
            report: PushReport = replica.push(weights, key)
            if paused:
                paused = False
                replica.resume()
        except ReplicaDown as err:
            self._down(member, err, f"pushing the weights of step {key.step}")
            return
        finally:
            if paused:
                try:
                    replica.resume()
                except ReplicaDown:
                    pass
        with self.lock:
            member.version, member.up, member.error = key, True, None
            member.push_seconds += seconds + report.seconds
            member.push_bytes += size + report.bytes

    # ------------------------------------------------------------------ the rest of the backend
    def stats(self) -> dict[str, torch.Tensor]:
        """``fleet/size``, ``fleet/servers_up`` and per server ``fleet/<i>/requests``, ``tokens_per_s`` (while
        busy), ``queue_depth`` (outstanding tokens now), ``push_s`` and ``push_bytes``, since the last call; the
        same keys on every rank."""
        out = {"fleet/size": float(len(self.members)), "fleet/servers_up": float(self.up())}
        with self.lock:
            for m in self.members:
                busy = m.busy_seconds()
                figures = {
                    "requests": m.requests,
                    "tokens_per_s": m.tokens / busy if busy > 0 else 0.0,
                    "queue_depth": m.outstanding,
                    "push_s": m.push_seconds,
                    "push_bytes": m.push_bytes,
                }
                out.update({f"fleet/{m.index}/{k}": float(v) for k, v in figures.items()})
                m.requests = m.tokens = m.push_bytes = 0
                m.push_seconds = 0.0
        return {k: torch.tensor(v) for k, v in out.items()}

    def sleep(self) -> None:
        """Nothing to free: the servers' memory is their own."""

    def close(self) -> None:
        self.sampling.shutdown(wait=False, cancel_futures=True)
        self.pushing.shutdown(wait=False, cancel_futures=True)
        for member in self.members:
            try:
                member.replica.close()
            except (OSError, ReplicaDown):
                pass


def _serves(member: Member, version: WeightsVersion | None, newer: bool) -> bool:
    return version is None or (member.version is not None and member.version.serves(version, newer))


def _step(version: WeightsVersion | None) -> str:
    """How messages name a version: its step (the run's id stays out of logs)."""
    return "any" if version is None else str(version.step)


def _answers(replica: Replica) -> bool:
    try:
        return bool(replica.alive())
    except (OSError, ReplicaDown):
        return False
