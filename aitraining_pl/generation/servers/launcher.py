"""The generation servers the trainer starts on this machine (``generation.server: launch`` for one,
``{launch: {count: N, engine, devices}}`` for a fleet; ``GenerationConfig.fleet`` makes the first a fleet of one) and
stops at the end of the run.

Rank 0 writes the policy's config and tokenizer to one private folder per server (a server builds the architecture
from them and holds no weights until the first push) and starts each as a child process (``start.spawn``: a ``vllm
serve`` or this project's HF server) on a free loopback port, with a fresh token in an owner-only file there,
``generation.server_threads`` CPU threads and, on a GPU machine, GPUs of its own (``launch.devices``, else the
visible GPUs after the trainer's, split evenly). The servers start in parallel; the run's other ranks connect to them
(``endpoints``: each URL and token file, broadcast: one machine). ``stop`` (the module's ``teardown``) asks each to
stop (SIGTERM), waits, kills it if it does not, and deletes its folder; an ``atexit`` hook does the same if the
process ends another way (an exception in ``fit``), and a trainer killed outright (SIGKILL, the OOM killer) takes its
servers with it (``auth.watch_parent``): no server outlives its trainer."""

from __future__ import annotations

import atexit
import concurrent.futures
import tempfile
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import LaunchConfig
from aitraining_pl.generation.images import save_model_files
from aitraining_pl.generation.servers.start import ServerProcess, spawn
from aitraining_pl.models.routing_replay import moe_routers

#: seconds a launched server has to answer its health route (it imports torch and transformers or vLLM, builds the
#: model)
START_TIMEOUT = 300.0


def spread(launch: LaunchConfig, trainer_gpus: int) -> list[list[int] | None]:
    """Each server's GPUs when ``launch.devices`` is unset: the GPUs after the trainer's, split evenly (none on a
    machine without GPUs, or for one server: ``start.server_devices`` then picks them); a ``ConfigError`` naming the
    option when there are fewer than servers."""
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


def lora_rank(policy: torch.nn.Module) -> int | None:
    """The rank of a LoRA policy whose adapter travels alone (``adapters.supported``: vLLM then serves it with
    ``--enable-lora``); None for any other policy."""
    from aitraining_pl.generation.servers.adapters import supported
    from aitraining_pl.models.lora import is_peft_model

    if is_peft_model(policy) and supported(policy):
        return int(policy.peft_config[policy.active_adapter].r)
    return None


class LaunchedFleet:
    """The servers this process (rank 0) started for the run (see the module docstring); ``stop`` ends them all.

    Args:
        launch: the servers to start (``count``, ``engine``, ``devices``).
        generation: the run's ``generation`` (``vllm``'s engine options, ``server_threads``).
        policy, tokenizer: what the servers serve (the architecture, dtype and LoRA rank; the trainer pushes the
            weights).
        seed: the servers' seed (requests carry their own).
        trainer_gpus: GPUs the trainer uses (a server's default devices are the ones after them).
        adapter_rank: the largest LoRA rank of the adapters pushed to a ``vllm serve`` (default: the policy's own,
            ``lora_rank``; a ``tinker-serve`` pushes its clients' adapters over a plain base model).
    """

    def __init__(self, launch: LaunchConfig, generation: Any, policy: torch.nn.Module, tokenizer: Any, seed: int = 0,
                 trainer_gpus: int = 1, adapter_rank: int | None = None):  # fmt: skip
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        devices = [[int(i) for i in str(d).split(",")] for d in launch.devices or []] or spread(launch, trainer_gpus)
        routes = bool(getattr(generation, "routing_replay", False)) and bool(moe_routers(policy))
        options = dict(options=generation.vllm, dtype=dtype, seed=seed, threads=generation.server_threads,
                       trainer_gpus=trainer_gpus, lora_rank=adapter_rank or lora_rank(policy),
                       routes=routes)  # fmt: skip
        self.servers: list[ServerProcess] = []
        atexit.register(self.stop)
        try:  # started from this thread (they die with it), then waited for together
            for devices_of in devices:
                folder = Path(tempfile.mkdtemp(prefix="aitraining-pl-serve-"))
                save_model_files(policy, tokenizer, folder)
                self.servers.append(spawn(launch.engine, folder, devices=devices_of, **options))
            with concurrent.futures.ThreadPoolExecutor(launch.count) as pool:
                list(pool.map(lambda server: server.wait_ready(START_TIMEOUT), self.servers))
        except BaseException:
            self.stop()
            raise

    def endpoints(self) -> list[tuple[str, str]]:
        """``(url, token file)`` of each server."""
        return [(s.url, str(s.token_file)) for s in self.servers]

    def tail(self, chars: int = 2000) -> str:
        """The end of each server's log (for messages)."""
        return "\n".join(f"{s.url}:\n{s.tail(chars)}" for s in self.servers)

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL) and delete its folder; idempotent."""
        for server in self.servers:
            server.stop()
        atexit.unregister(self.stop)
