"""What a fleet is built from (``generation.server``): the replica of each URL by its scheme (``REPLICAS``;
``http_replica`` for ``http``/``https``), the servers the trainer starts for a fleet (``LaunchedFleet``), and the
fleet itself (``build_fleet``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import LaunchConfig, ServerConfig
from aitraining_pl.generation.images import save_model_files
from aitraining_pl.generation.servers.auth import check_guarded, find_token
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.replica import Replica
from aitraining_pl.generation.servers.start import ServerProcess, spawn

#: what builds the ``Replica`` of a URL, by its scheme (``"module:name"``, imported only when a URL of that scheme is
#: used), called as ``(url, generation, context, token_file, connect_timeout)``
REPLICAS = {
    "http": "aitraining_pl.generation.servers.fleet_launch:http_replica",
    "https": "aitraining_pl.generation.servers.fleet_launch:http_replica",
    "tcp": "aitraining_pl.generation.servers.tcp_replica:TCPReplica",  # ``aitraining-pl serve``'s frames (one release)
}
#: seconds a launched server has to answer its health route (it imports torch, builds the model)
START_TIMEOUT = 300.0


def http_replica(url: str, generation: Any, context: Any, token_file: str | None, connect_timeout: float):
    """The ``HTTPReplica`` of ``url`` with the run's token (``token_file``, else ``generation.vllm``'s token file,
    else ``AITRAINING_PL_SERVER_TOKEN``); a server other machines can reach must require it."""
    options = generation.vllm
    if token_file:
        options = dataclasses.replace(options, server_token_file=token_file)
    replica = HTTPReplica(url, find_token(options, "generation.vllm.server_token_file"), timeout=options.server_timeout)
    check_guarded(replica.url, bool(getattr(options, "allow_unauthenticated", False)))
    return replica


def replica_factory(url: str) -> Callable[..., Replica]:
    """What builds the ``Replica`` of ``url`` (``REPLICAS``)."""
    module, _, name = REPLICAS[url.partition("://")[0].lower()].partition(":")
    return getattr(importlib.import_module(module), name)


def build_fleet(
    servers: ServerConfig, endpoints: Sequence[tuple[str, str | None]], generation: Any, context: Any, weights
) -> Fleet:
    """The fleet of ``endpoints`` (``(url, token file or None)``, one per server) for ``generation.server``
    ``servers`` and a ``BackendContext``; each replica is ``replica_factory(url)(url, generation, context, token_file,
    connect_timeout)``. ``weights``: ``policy_weights``."""
    timeout = float(servers.connect_timeout)
    replicas = [replica_factory(url)(url, generation, context, token, timeout) for url, token in endpoints]
    return Fleet(replicas, weights, context.rank, context.run, timeout, float(servers.token_timeout),
                 bool(generation.vllm.sync_weights))  # fmt: skip


def spread(launch: LaunchConfig, trainer_gpus: int) -> list[list[int] | None]:
    """Each server's GPUs when ``launch.devices`` is unset: the GPUs after the trainer's, split evenly (none on a
    machine without GPUs); a ``ConfigError`` naming the option when there are fewer than servers."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    free = list(range(trainer_gpus, count))
    if count == 0 or launch.count == 1:
        return [None] * launch.count
    if len(free) < launch.count:
        raise ConfigError(
            "generation.server.launch.devices",
            f"{launch.count} servers, {len(free)} GPUs besides the trainer's {trainer_gpus}: give each its own",
        )
    share = len(free) // launch.count
    return [free[i * share : (i + 1) * share] for i in range(launch.count)]


class LaunchedFleet:
    """``generation.server: {launch: {count: N, engine, devices}}``: rank 0 starts N servers in parallel
    (``start.start``: each on a free loopback port with its own token, its own ``devices[i]``, dying with the
    trainer) from one folder per server holding the policy's config and tokenizer; ``stop`` ends them all.

    Args:
        launch: the servers to start.
        generation: the run's ``generation`` (``vllm``'s engine options, ``server_threads``).
        policy, tokenizer: what the servers serve (the architecture; the trainer pushes the weights).
        seed: the servers' seed (requests carry their own).
        trainer_gpus: GPUs the trainer uses (a server's default devices are the ones after them).
    """

    def __init__(self, launch: LaunchConfig, generation: Any, policy: torch.nn.Module, tokenizer: Any, seed: int = 0,
                 trainer_gpus: int = 1):  # fmt: skip
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        devices = [[int(i) for i in str(d).split(",")] for d in launch.devices or []] or spread(launch, trainer_gpus)
        folders = []
        for _ in range(launch.count):
            folder = Path(tempfile.mkdtemp(prefix="aitraining-pl-fleet-"))
            save_model_files(policy, tokenizer, folder)
            folders.append(folder)
        options = dict(options=generation.vllm, dtype=dtype, seed=seed, threads=generation.server_threads,
                       trainer_gpus=trainer_gpus)  # fmt: skip
        self.servers: list[ServerProcess] = []
        try:  # started from this thread (they die with it), then waited for together
            for folder, devices_of in zip(folders, devices):
                self.servers.append(spawn(launch.engine, folder, devices=devices_of, **options))
            with concurrent.futures.ThreadPoolExecutor(launch.count) as pool:
                list(pool.map(lambda server: server.wait_ready(START_TIMEOUT), self.servers))
        except BaseException:
            self.stop()
            raise

    def endpoints(self) -> list[tuple[str, str]]:
        """``(url, token file)`` of each server."""
        return [(s.url, str(s.token_file)) for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
