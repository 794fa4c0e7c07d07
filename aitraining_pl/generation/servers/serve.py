"""``aitraining-pl serve`` (also named ``vllm-serve``): the command that builds an engine for the policy's architecture
and serves a training run's rollouts from it (``servers.tcp_server``; docs/vllm.md, Server mode): ``--engine vllm``
(the default; ``generation.vllm.VLLMEngine``) or ``hf`` (``hf_server.HFServerEngine``, this project's decoder: no vLLM
needed, never imported). Its options, whose defaults are ``VLLMConfig``'s, the token it needs before anything is
built (``tcp_guards.server_token``), and ``launch``, which starts it as a child process from Python."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.servers.tcp_guards import Limits, server_token, write_token
from aitraining_pl.generation.servers.tcp_server import GenerationServer
from aitraining_pl.generation.servers.tcp_wire import TOKEN_ENV
from aitraining_pl.generation.vllm import import_vllm
from aitraining_pl.models.loading import build_causal_lm, from_pretrained, load_tokenizer, one_line, resolve_dtype
from aitraining_pl.models.presets import MODEL_PRESETS


def is_inline(model: str) -> bool:
    """Whether ``--model`` is a preset name or an inline JSON config (else a folder or a hub id)."""
    return model in MODEL_PRESETS or model.lstrip().startswith("{")


def meta_model(model: str, dtype: str | None) -> torch.nn.Module:
    """The policy's architecture on the meta device (no memory, no weights): ``model`` is a folder with a
    ``config.json``, a hub id, a preset name (``tiny-llama``) or an inline JSON config (``{"preset": ...}``)."""
    import transformers

    torch_dtype = resolve_dtype(dtype)
    if is_inline(model):
        try:
            spec = json.loads(model) if model.lstrip().startswith("{") else model
            with torch.device("meta"):
                return build_causal_lm(spec, dtype=torch_dtype)
        except ValueError as err:
            raise ConfigError(f"--model {model}", one_line(err)) from None
    from aitraining_pl.models.vision import is_vision_model_type

    config = from_pretrained(transformers.AutoConfig.from_pretrained, model, "model")
    auto = "AutoModelForImageTextToText" if is_vision_model_type(config.model_type) else "AutoModelForCausalLM"
    with torch.device("meta"):
        return getattr(transformers, auto).from_config(
            config, dtype=torch_dtype or getattr(config, "dtype", None) or torch.float32
        )


#: ``--gpu_memory_utilization``'s default: the GPU is the server's alone (``VLLMConfig``'s 0.3 leaves room for
#: training beside a colocated engine); TRL's ``vllm-serve`` takes 0.9 too
SERVER_GPU_MEMORY = 0.9


def _flag(text: str) -> bool | str:
    """``--enforce_eager``'s value: true / false, or ``auto`` (``VLLMConfig.eager``)."""
    lowered = text.lower()
    if lowered == "auto":
        return "auto"
    if lowered in ("1", "true", "yes", "0", "false", "no"):
        return lowered in ("1", "true", "yes")
    raise argparse.ArgumentTypeError(f"{text!r}: true, false or auto")


#: the engines ``--engine`` names
ENGINES = ("vllm", "hf")


def parser(command: str = "vllm-serve") -> argparse.ArgumentParser:
    """The options of ``serve`` / ``vllm-serve`` (``command``); the engine's and the connection's defaults are
    ``VLLMConfig``'s, the limits' ``guards.Limits``'s."""
    defaults, limits = VLLMConfig(), Limits()
    p = argparse.ArgumentParser(
        prog=f"aitraining-pl {command}",
        description="Serve a training run's rollouts from an engine in this process (generation.vllm.mode: "
        "server): vLLM, or this project's HF decoder (--engine hf). The engine starts with the model's "
        "architecture and no trained weights; the trainer's rank 0 pushes them before each rollout whose "
        "weights changed. docs/vllm.md, Server mode.",
    )
    add = p.add_argument
    add(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="vllm (default) or hf: this project's KV-cache decoder, on the GPU when there is one, else the CPU "
        "(no vLLM needed; pushes may land mid-generation, load in_flight); the vLLM options below are then ignored",
    )
    add("--threads", type=int, default=None, help="torch's CPU threads in this process (default: torch's own)")
    add(
        "--model",
        required=True,
        help="the policy's architecture (its weights come from the trainer): a folder with config.json and the "
        'tokenizer, a hub id, a preset (tiny-llama) or an inline JSON config ({"preset": "tiny-llama", ...})',
    )
    add(
        "--teacher",
        action="store_true",
        help="serve --model's own weights, read at start, as a distillation teacher (DistillationModule "
        "teacher_server: its log-probs of the student's samples); pushes are refused. --model: a folder or hub id",
    )
    add("--tokenizer", default=None, help="tokenizer folder, hub id or 'byte' (default: --model's folder)")
    add(
        "--host",
        default=defaults.server_host,
        help=f"address to listen on (default {defaults.server_host}: this machine only; any other needs a token)",
    )
    add("--port", type=int, default=defaults.server_port, help="TCP port (0: any free one, printed)")
    add(
        "--token_file",
        default=None,
        help=f"a file holding the shared secret the trainer must prove (else ${TOKEN_ENV}; else, on a loopback "
        "--host, a new one written to an owner-only file named by the port, whose path is printed)",
    )
    add(
        "--weight_port",
        type=int,
        default=0,
        help="TCP port of the weight channel's store when the trainer opens one (generation.vllm.weight_channel "
        "nccl or gloo; 0: any free one)",
    )
    add("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the config's, else float32)")
    add("--seed", type=int, default=0, help="the engine's seed (requests with a seed use their own)")
    add(
        "--max_model_len",
        type=int,
        default=defaults.max_model_len,
        help="longest prompt + response (default: the model's)",
    )
    add(
        "--gpu_memory_utilization",
        type=float,
        default=SERVER_GPU_MEMORY,
        help=f"share of the GPU vLLM takes ({SERVER_GPU_MEMORY}: the GPU is the server's)",
    )
    add(
        "--tensor_parallel_size",
        type=int,
        default=defaults.tensor_parallel_size,
        help="GPUs the engine splits the model over",
    )
    add("--cpu_kv_cache_gb", type=float, default=defaults.cpu_kv_cache_gb, help="KV cache on a CPU (GiB)")
    add(
        "--enforce_eager",
        type=_flag,
        default=defaults.enforce_eager,
        help=f"no CUDA graphs: true, false or auto (eager on a CPU, CUDA graphs on a GPU; default "
        f"{defaults.enforce_eager})",
    )
    add(
        "--batch_wait_ms",
        type=float,
        default=50.0,
        help="how long the ranks' sample requests wait for each other, to be served in one batch "
        "(50 ms; docs/vllm.md, Batching)",
    )
    add(
        "--timeout",
        type=float,
        default=limits.timeout,
        help="seconds a weight push may stay silent, a weight channel may take to be joined and a sample request "
        f"may wait for its weights (default {limits.timeout:g}, generation.vllm.server_timeout's)",
    )
    add(
        "--idle_timeout",
        type=float,
        default=limits.idle_timeout,
        help=f"seconds a connection may stay silent before it is dropped (default {limits.idle_timeout:g})",
    )
    add(
        "--max_connections",
        type=int,
        default=limits.max_connections,
        help=f"open connections at most, one per training process (default {limits.max_connections})",
    )
    return p  # fmt: skip


def launch(argv: list[str], log: str | os.PathLike, timeout: float = 300.0) -> tuple[subprocess.Popen, int]:
    """Start ``aitraining-pl serve ARGV`` as a child process (this interpreter, its output in the file ``log``;
    ``--engine`` in ``argv`` picks the engine, vLLM by default) and wait until it listens: the process and its port
    (``--port 0`` picks a free one). A server that exits or is not listening after ``timeout`` seconds is a
    ``RuntimeError`` with the end of its log."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aitraining_pl.cli", "serve", *argv], env=env, stdout=sink, stderr=sink
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log, errors="replace") as source:
            found = re.search(r"serve: listening on \S+:(\d+) ", source.read())
        if found:
            return proc, int(found.group(1))
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    with open(log, errors="replace") as source:
        raise RuntimeError(f"the generation server did not start (exit status {proc.wait()}):\n{source.read()[-3000:]}")


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def load_teacher(engine: Any, model: str) -> None:
    """Load ``model``'s own weights (a folder or hub id) into an ``HFServerEngine`` as a teacher's fixed version."""
    import transformers

    teacher = from_pretrained(transformers.AutoModelForCausalLM.from_pretrained, model, "model")
    engine.load(teacher.state_dict().items(), f"teacher {model}")


def build_engine(args: argparse.Namespace, policy: torch.nn.Module, tokenizer: Any) -> Any:
    """The engine ``--engine`` names for ``policy`` (meta device), holding ``--model``'s own weights with
    ``--teacher``."""
    if args.engine == "hf":
        from aitraining_pl.generation.servers.hf_server import HFServerEngine

        engine = HFServerEngine(policy, seed=args.seed)
        if args.teacher:
            load_teacher(engine, args.model)
        return engine
    from aitraining_pl.generation.vllm import VLLMEngine

    options = VLLMConfig(
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
    )
    engine = VLLMEngine(policy, tokenizer, options, seed=args.seed, weights=args.model if args.teacher else None)
    if args.teacher:
        engine.version = f"teacher {args.model}"
    return engine


def main(argv: list[str], command: str = "vllm-serve") -> None:
    """Build the engine and serve until interrupted (``aitraining-pl serve --help``; ``command``: the name it was
    called by, which its log lines start with)."""
    args = parser(command).parse_args(argv)
    token, generated = server_token(args.host, args.token_file)  # before the engine: a refusal costs nothing
    limits = Limits(args.timeout, args.idle_timeout, max_connections=args.max_connections)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("--threads", f"must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.engine == "vllm":
        import_vllm()  # one line naming the extra when vLLM is missing
    tokenizer_name = args.tokenizer or (None if is_inline(args.model) else args.model)
    if tokenizer_name is None:
        raise ConfigError("--tokenizer", f"needed with --model {args.model} (default: the model folder's or hub id's)")
    if args.teacher and is_inline(args.model):
        raise ConfigError("--teacher", f"serves the weights of --model, a folder or hub id, not {args.model}")
    policy = meta_model(args.model, None if args.dtype == "auto" else args.dtype)
    tokenizer = load_tokenizer(tokenizer_name)
    engine = build_engine(args, policy, tokenizer)
    try:
        batch_wait = args.batch_wait_ms / 1000
        server = GenerationServer(
            engine, tokenizer, policy, args.host, args.port, token, args.weight_port, batch_wait, limits, args.teacher,
            command,
        )  # fmt: skip
    except OSError as err:
        engine.close()
        where = f"--host {args.host} --port {args.port}"
        raise ConfigError(where, f"cannot listen there ({err.strerror or err})") from None
    host, port = server.server_address[:2]
    token_file = write_token(token, port) if generated else None
    if token_file is not None:
        server.log(f"token written to {token_file} (owner-only; a trainer on this machine reads it from there)")
    kind = f"{args.engine} engine, {server.model['model_type']}, {args.dtype}"
    serving = f"the teacher's weights from {args.model}" if args.teacher else "waiting for the trainer's weights"
    server.log(f"listening on {host}:{port} ({kind}; {serving})")
    signal.signal(signal.SIGTERM, _interrupt)  # ``kill``: shut the engine down and delete its folder
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
        if token_file is not None:
            token_file.unlink(missing_ok=True)
