"""``aitraining-pl vllm-serve``: a launcher of vLLM's own ``vllm serve`` with the flags this project's
client needs (``start.VLLM_FLAGS``: the token middleware, the worker extension, the processed log-probs, no
checkpoint weights), ``VLLM_SERVER_DEV_MODE=1`` and the run's token.

``aitraining-pl vllm-serve --model M [--host H] [--port P] [--token_file F] [vLLM's own options ...]``: the token is
``$AITRAINING_PL_SERVER_TOKEN``, else the file ``--token_file``, else, on a loopback host, a new one written to an
owner-only file named by the port (the trainer on this machine finds it there; its path is printed); a host other
machines can reach needs one given. Every other option goes to vLLM unchanged (``--dtype``, ``--data-parallel-size``,
``--enable-lora``, ...). The command line is printed, then this process becomes vLLM (``exec``).

On a machine without CUDA it adds ``start.CPU_FLAGS`` (``--gpu-memory-utilization 0.1``: on a CPU vLLM reserves that
share of the RAM, 0.92 by default; ``--no-enable-chunked-prefill``) unless given, and ``VLLM_CPU_KVCACHE_SPACE`` 1
(GiB of KV cache) unless set.

``--teacher``: a distillation teacher (``DistillationModule teacher_server: {url: ...}``): vLLM reads ``--model``'s own
weights and takes no pushes (``start.SERVE_FLAGS``: the token middleware, no worker extension, no dev mode)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import EXTRA_CPU, EXTRA_GPU
from aitraining_pl.generation.registry import vllm_available
from aitraining_pl.generation.servers import auth
from aitraining_pl.generation.servers.start import CPU_FLAGS, CPU_KV_CACHE_GB, SERVE_FLAGS, VLLM_FLAGS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aitraining-pl vllm-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the policy's folder or hub id (its config and tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--token_file", default=None, help="a file holding the run's token (owner-only)")
    return p


def command(argv: list[str], gpu: bool | None = None) -> tuple[list[str], dict[str, str], str]:
    """The ``vllm serve`` command line, its environment and where its token lives (for the message); ``gpu``:
    whether vLLM runs on CUDA (None: whether this machine has it)."""
    args, rest = parser().parse_known_args(argv)
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    teacher = "--teacher" in rest
    rest = [arg for arg in rest if arg != "--teacher"]
    env = {**os.environ, **({} if teacher else {"VLLM_SERVER_DEV_MODE": "1"})}  # a teacher needs no RL routes
    if os.environ.get(auth.TOKEN_ENV):
        where = f"${auth.TOKEN_ENV}"
    elif args.token_file:
        env[auth.TOKEN_FILE_ENV] = where = os.path.abspath(args.token_file)
    elif auth.is_loopback(args.host):
        path = auth.write_token(auth.token_path(args.port), auth.new_token())
        env[auth.TOKEN_FILE_ENV] = where = str(path)
    else:
        raise ConfigError(
            f"--host {args.host}",
            f"a server other machines can reach needs the run's token: set {auth.TOKEN_ENV} or --token_file (the "
            "same on the trainer: the variable or generation.vllm.server_token_file); docs/vllm.md",
        )
    cpu = [] if gpu else _missing(CPU_FLAGS, {arg.split("=")[0] for arg in rest})  # those the user did not give
    if not gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GB))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", args.host,
            "--port", str(args.port), *(SERVE_FLAGS if teacher else VLLM_FLAGS), *cpu, *rest]  # fmt: skip
    return argv, env, where


def _missing(flags: tuple[str, ...], given: set[str]) -> list[str]:
    """``flags`` (options, each maybe followed by its value) without the options in ``given``."""
    out: list[str] = []
    for flag in flags:
        if flag.startswith("--"):
            skip = flag in given or (flag == "--no-enable-chunked-prefill" and "--enable-chunked-prefill" in given)
        if not skip:
            out.append(flag)
    return out


def main(argv: list[str]) -> None:
    """Print the command and become it (one line naming the extra when vLLM is not installed: ``exec`` would fail
    only after this process is gone)."""
    if not vllm_available():
        raise ConfigError(
            "vllm-serve",
            f"needs the vLLM package, which is not installed: pip install -e '.[{EXTRA_GPU}]' on a GPU machine, "
            f"'.[{EXTRA_CPU}]' on a CPU-only one (README: Installation)",
        )
    line, env, where = command(argv)
    print(f"vllm-serve: the token is in {where}; running: {shlex.join(line)}", file=sys.stderr, flush=True)
    os.execvpe(line[0], line, env)
