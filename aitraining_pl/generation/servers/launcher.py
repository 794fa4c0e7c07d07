"""``generation.server: launch``: the trainer starts the generation server it needs on this machine (a ``vllm serve``
for ``backend: vllm``, else this project's HF server over the same HTTP routes; ``generation.servers.start``) and
stops it at the end of the run.

Rank 0 writes the policy's config and tokenizer to a private folder (the server builds the architecture from them
and holds no weights until the first push) and starts the server as a child process on a free loopback port, with a
fresh token in an owner-only file there, ``generation.server_threads`` CPU threads and, on a GPU machine, GPUs of
its own (``generation.server_devices``, else the visible GPUs after the trainer's). The run's other ranks connect to
it (the port and the token file are broadcast: one machine). ``LaunchedServer.stop`` (the module's ``teardown``)
asks the server to stop (SIGTERM), waits, kills it if it does not, and deletes the folder; an ``atexit`` hook does
the same if the process ends another way (an exception in ``fit``), and a trainer killed outright (SIGKILL, the OOM
killer) takes its server with it (``auth.watch_parent``): no server outlives its trainer.
"""

from __future__ import annotations

import atexit
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.generation.images import save_model_files
from aitraining_pl.generation.servers.start import start

#: seconds a launched server has to answer (it imports torch and transformers or vLLM, builds the model)
START_TIMEOUT = 300.0


class LaunchedServer:
    """A generation server started by this process (rank 0); ``stop`` ends it.

    Args:
        generation: the run's ``generation`` (``backend`` names the engine, ``server_threads`` its threads,
            ``server_devices`` its GPUs, ``vllm`` its engine options).
        policy: the policy (its config, dtype and LoRA rank decide the served architecture).
        tokenizer: the policy's tokenizer (saved for the server).
        seed: the server's seed (requests of an asynchronous run carry their own).
        trainer_gpus: GPUs of this machine the training processes use (the server's come after them).
    """

    def __init__(self, generation: GenerationConfig, policy: torch.nn.Module, tokenizer: Any, seed: int = 0,
                 trainer_gpus: int = 1):  # fmt: skip
        from aitraining_pl.generation.servers.adapters import supported
        from aitraining_pl.models.lora import is_peft_model

        self.folder = Path(tempfile.mkdtemp(prefix="aitraining-pl-serve-"))
        save_model_files(policy, tokenizer, self.folder)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        engine = "vllm" if generation.backend == "vllm" else "hf"
        lora = is_peft_model(policy) and supported(policy)
        rank = policy.peft_config[policy.active_adapter].r if lora else None
        self.server = start(
            engine, self.folder, options=generation.vllm, dtype=dtype, seed=seed, threads=generation.server_threads,
            devices=generation.server_devices, trainer_gpus=trainer_gpus, lora_rank=rank, timeout=START_TIMEOUT,
        )  # fmt: skip
        self.process, self.log, self.token_file = self.server.process, self.server.log, self.server.token_file
        self.port = int(self.server.url.rpartition(":")[2])
        atexit.register(self.stop)

    def connection(self, generation: GenerationConfig, port: int | None = None, token_file: str | None = None):
        """``generation`` set to connect to this server (or, on another rank, to ``port`` with ``token_file``)."""
        return connect_to(generation, port or self.port, token_file or str(self.token_file))

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and delete its folder; idempotent."""
        self.process = None
        self.server.stop()
        atexit.unregister(self.stop)

    def tail(self, chars: int = 2000) -> str:
        """The end of the server's log (for messages)."""
        return self.server.tail(chars)


def connect_to(generation: GenerationConfig, port: int, token_file: str) -> GenerationConfig:
    """A copy of ``generation`` that connects to a server on this machine at ``port`` with the token in
    ``token_file`` (the engine options, given to the server it launched, back to their defaults: nothing to warn)."""
    owned = {name: getattr(VLLMConfig(), name) for name in VLLMConfig.SERVER_OWNED}
    vllm = dataclasses.replace(generation.vllm, server_host="127.0.0.1", server_port=int(port),
                               server_token_file=token_file, protocol="http", **owned)  # fmt: skip
    return dataclasses.replace(generation, server="connect", vllm=vllm)
