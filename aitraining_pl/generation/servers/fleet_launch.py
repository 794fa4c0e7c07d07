"""What a fleet is built from (``generation.server``): the replica of a URL by its scheme (``http_replica``, the
``REPLICAS`` entry of ``http``/``https``) and the servers the trainer starts for a fleet (``LaunchedFleet``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.generation.config import LaunchConfig
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.served import check_guarded, find_token
from aitraining_pl.generation.servers.start import ServerProcess, spawn
from aitraining_pl.models.generation import hf_model

#: seconds a launched server has to answer its health route (it imports torch, builds the model)
START_TIMEOUT = 300.0


def http_replica(url: str, generation: Any, context: Any, token_file: str | None, connect_timeout: float):
    """The ``HTTPReplica`` of ``url`` with the run's token (``token_file``, else ``generation.vllm``'s token file,
    else ``AITRAINING_PL_SERVER_TOKEN``); a server other machines can reach must require it."""
    options = generation.vllm
    if token_file:
        options = dataclasses.replace(options, server_token_file=token_file)
    replica = HTTPReplica(url, find_token(options, "generation.vllm.server_token_file"), timeout=options.server_timeout)
    check_guarded(replica, bool(getattr(options, "allow_unauthenticated", False)))
    return replica


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
        devices = [None if d is None else [int(i) for i in str(d).split(",")] for d in launch.devices or []]
        devices += [None] * (launch.count - len(devices))
        folders = []
        for _ in range(launch.count):
            folder = Path(tempfile.mkdtemp(prefix="aitraining-pl-fleet-"))
            hf_model(policy).config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
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
