"""``generation.server: launch``: the trainer starts the generation server it needs (``aitraining-pl serve --engine
<backend>``, ``generation.servers.serve``) on this machine and stops it at the end of the run.

Rank 0 writes the policy's config and tokenizer to a private folder (the server builds the architecture from them
and holds no weights until the first push), a fresh token to an owner-only file there, and starts the server as a
child process on a free loopback port with ``generation.server_threads`` CPU threads. The run's other ranks connect
to it (the port and the token file are broadcast: one machine). ``LaunchedServer.stop`` (the module's ``teardown``)
asks the server to stop (SIGTERM), waits, kills it if it does not, and deletes the folder; an ``atexit`` hook does
the same if the process ends another way (an exception in ``fit``), so no server outlives its trainer.
"""

from __future__ import annotations

import atexit
import dataclasses
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.models.generation import hf_model

#: seconds a launched server has to start listening (it imports torch and transformers, builds the model)
START_TIMEOUT = 300.0
#: seconds a launched server has to exit after SIGTERM before it is killed
STOP_TIMEOUT = 30.0


class LaunchedServer:
    """A generation server started by this process (rank 0); ``stop`` ends it.

    Args:
        generation: the run's ``generation`` (``backend`` names the engine, ``server_threads`` its threads).
        policy: the policy (its config, dtype and device decide the served architecture).
        tokenizer: the policy's tokenizer (saved for the server).
        seed: the server's seed (requests of an asynchronous run carry their own).
    """

    def __init__(self, generation: GenerationConfig, policy: torch.nn.Module, tokenizer: Any, seed: int = 0):
        from aitraining_pl.generation.servers.serve import launch

        self.folder = Path(tempfile.mkdtemp(prefix="aitraining-pl-serve-"))
        model = hf_model(policy)
        model.config.save_pretrained(self.folder)
        tokenizer.save_pretrained(self.folder)
        self.token_file = self.folder / "token"
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        engine = "vllm" if generation.backend == "vllm" else "hf"
        argv = [
            "--engine", engine, "--model", str(self.folder), "--host", "127.0.0.1", "--port", "0",
            "--token_file", str(self.token_file), "--threads", str(generation.server_threads),
            "--seed", str(seed), "--dtype", dtype, "--timeout", str(generation.vllm.server_timeout),
        ]  # fmt: skip
        if engine == "vllm":  # the engine options are the run's (``VLLMConfig.SERVER_OWNED``), given to the server
            options = generation.vllm
            argv += ["--gpu_memory_utilization", str(options.gpu_memory_utilization),
                     "--cpu_kv_cache_gb", str(options.cpu_kv_cache_gb),
                     "--tensor_parallel_size", str(options.tensor_parallel_size),
                     "--enforce_eager", str(options.enforce_eager).lower()]  # fmt: skip
            if options.max_model_len:
                argv += ["--max_model_len", str(options.max_model_len)]
        self.log = self.folder / "server.log"
        self.process: subprocess.Popen | None = None
        self.process, self.port = launch(argv, self.log, START_TIMEOUT)
        atexit.register(self.stop)

    def connection(self, generation: GenerationConfig, port: int | None = None, token_file: str | None = None):
        """``generation`` set to connect to this server (or, on another rank, to ``port`` with ``token_file``)."""
        return connect_to(generation, port or self.port, token_file or str(self.token_file))

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``STOP_TIMEOUT`` s) and delete its folder; idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)
        atexit.unregister(self.stop)

    def tail(self, chars: int = 2000) -> str:
        """The end of the server's log (for messages)."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def connect_to(generation: GenerationConfig, port: int, token_file: str) -> GenerationConfig:
    """A copy of ``generation`` that connects to a server on this machine at ``port`` with the token in
    ``token_file`` (the engine options, given to the server it launched, back to their defaults: nothing to warn)."""
    owned = {name: getattr(VLLMConfig(), name) for name in VLLMConfig.SERVER_OWNED}
    vllm = dataclasses.replace(generation.vllm, server_host="127.0.0.1", server_port=int(port),
                               server_token_file=token_file, **owned)  # fmt: skip
    return dataclasses.replace(generation, server="connect", vllm=vllm)
