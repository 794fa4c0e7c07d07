"""``aitraining-pl tinker-serve --model M``: a server the ``tinker`` client (and tinker-cookbook recipes, through
their ``base_url``) trains on (``aitraining_pl.tinker.server``).

It binds loopback unless told otherwise. Its API keys (each must start with ``tml-``, as the client requires) come
from ``--api-key-file`` (one a line; one tenant each), else from the project's server token
(``AITRAINING_PL_SERVER_TOKEN_FILE`` / ``AITRAINING_PL_SERVER_TOKEN``), else a new key is written to an owner-only
file beside the checkpoints, whose path (never the key) is printed. Point the client at it with
``TINKER_BASE_URL=http://127.0.0.1:PORT`` and ``TINKER_API_KEY=$(cat FILE)``.

It samples in process (``--sampler hf``), or on generation servers it launches or reaches (``--sampler hf|vllm
--sampler-server launch|launch:N|URL[,URL...]``; ``tinker.served``), which it stops when it ends."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from aitraining_pl.generation.servers.auth import TOKEN_ENV, TOKEN_FILE_ENV, new_token, write_token
from aitraining_pl.tinker.engine import PRECISIONS, Engine
from aitraining_pl.tinker.served import sampler_generation
from aitraining_pl.tinker.server import State, build_app


def parser() -> argparse.ArgumentParser:
    args = argparse.ArgumentParser("aitraining-pl tinker-serve", description=__doc__.split("\n\n")[0])
    args.add_argument("--model", required=True, help="folder or hub id of the base causal LM")
    args.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    args.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    args.add_argument("--precision", default="32-true", choices=PRECISIONS,
                      help="Lightning precision plugin (adapters and AdamW state stay float32)")  # fmt: skip
    args.add_argument("--device", default=None, help="one process: cuda, cuda:1, cpu (default: CUDA if available)")
    args.add_argument("--strategy", default="auto", choices=("auto", "ddp", "fsdp2"),
                      help="--devices processes, rank 0 serves; ddp: each has the base; fsdp2: shards it")  # fmt: skip
    args.add_argument("--devices", type=int, default=1, help="processes, one device each (ddp, fsdp2)")
    args.add_argument("--accelerator", default="auto", help="cpu, cuda or auto, under --strategy ddp or fsdp2")
    args.add_argument("--checkpoint-dir", default="tinker_checkpoints", help="save_state / sampler weights folder")
    args.add_argument("--max-lora-rank", type=int, default=64, help="largest LoRA rank a client may ask for")
    args.add_argument("--api-key-file", default=None, help="file of API keys (tml-...), one a line")
    args.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body, in MiB")
    args.add_argument("--max-tokens", type=int, default=65536, help="most tokens in one request")
    args.add_argument("--max-datums", type=int, default=256, help="most datums in one forward_backward request")
    args.add_argument("--max-samples", type=int, default=64, help="most samples in one request")
    args.add_argument(
        "--sampler",
        default="hf",
        choices=("hf", "vllm"),
        help="what samples: hf (this project's HF decoder) or vllm (a vllm serve; docs/tinker.md)",
    )
    args.add_argument("--sampler-server", default="none",
                      help="where it samples: none (in this process; hf only), launch or launch:N (servers started "
                      "on this machine: a fleet of N), or URL[,URL...] of running ones (aitraining-pl vllm-serve, "
                      "the HF server)")  # fmt: skip
    args.add_argument(
        "--sampler-token-file",
        default=None,
        help="file holding the running servers' token (default: $AITRAINING_PL_SERVER_TOKEN)",
    )
    args.add_argument("--sampler-threads", type=int, default=1, help="CPU threads of each launched server")
    return args


def api_keys(key_file: str | None, checkpoint_dir: str) -> list[str]:
    """The server's keys (see the module docstring); a ``SystemExit`` line for a key without ``tml-``."""
    if key_file:
        keys = [line.strip() for line in Path(key_file).read_text().splitlines() if line.strip()]
    elif os.environ.get(TOKEN_FILE_ENV) or os.environ.get(TOKEN_ENV):
        source = os.environ.get(TOKEN_FILE_ENV)
        keys = [Path(source).read_text().strip() if source else os.environ[TOKEN_ENV].strip()]
    else:
        path = write_token(Path(checkpoint_dir) / "api_key", "tml-" + new_token())
        print(f"aitraining-pl tinker-serve: a new API key is in {path} (owner-only)", flush=True)
        keys = [path.read_text()]
    bad = [i for i, key in enumerate(keys) if not key.startswith("tml-")]
    if not keys or bad:
        raise SystemExit("aitraining-pl tinker-serve: every API key must start with 'tml-' (the tinker client "
                         f"refuses others); keys {bad} do not")  # fmt: skip
    return keys


def make_state(model: str, precision: str = "32-true", device: str | None = None,
               checkpoint_dir: str = "tinker_checkpoints", max_lora_rank: int = 64, max_body: int = 64 << 20,
               max_tokens: int = 65536, max_datums: int = 256, max_samples: int = 64,
               replicas=None, generation=None) -> State:  # fmt: skip
    """The server's state; ``replicas``: this rank's ``tinker.replicas.Replicas`` under ``--strategy ddp``;
    ``generation``: where it samples (``tinker.served.sampler_generation``; None: here)."""
    engine = Engine(model, precision, device, checkpoint_dir, max_lora_rank, replicas)
    served = None
    if generation is not None:
        from aitraining_pl.tinker.served import ServedSampling

        served = ServedSampling(engine.model, engine.tokenizer, generation, max_lora_rank, engine.device.type == "cuda")
    return State(engine, max_tokens, max_datums, max_samples, max_body, served)


def start_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """Run ``app`` with uvicorn on a background thread; returns ``(server, base_url)`` once it listens (tests,
    benchmarks). ``server.should_exit = True`` stops it."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tinker-serve", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("tinker-serve did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, f"http://{host}:{port}"


FSDP2_SERVERS = (
    "aitraining-pl tinker-serve: --strategy fsdp2 samples in process only (--sampler-server none): generation "
    "servers get the base model's weights from this process, where fsdp2 leaves each rank a shard of them; rank 0 "
    "samples on the base gathered by every rank for each request"
)


def launch(strategy: str, devices: int, accelerator: str, precision: str = "32-true"):
    """Start the ``--devices`` processes of ``--strategy ddp|fsdp2`` with Lightning Fabric (it re-runs this command
    once per extra rank); returns this rank's ``(tinker.replicas.Replicas, device)``, or ``(None, None)`` for one
    process. ``fsdp2`` is Fabric's ``ModelParallelStrategy`` on a data-parallel mesh of every rank, whose
    ``parallelize_fn`` is the project's FSDP2 sharding (``models.sharding.shard``, with ``precision``'s policy)."""
    if devices < 1 or (devices > 1 and strategy not in ("ddp", "fsdp2")):
        raise SystemExit(f"aitraining-pl tinker-serve: --devices {devices}: one, or more under --strategy ddp or fsdp2")
    if devices == 1:
        return None, None
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    from aitraining_pl.models.sharding import shard
    from aitraining_pl.strategies import sharding_mesh
    from aitraining_pl.tinker.replicas import Replicas

    def parallelize(model, mesh):
        # the same ranks as a mesh named "fsdp": peft sizes an adapter added to a Linear whose weight is a DTensor
        # by that weight's local shard (tensor parallelism) unless its mesh's only dimension is named "fsdp"
        ranks = sharding_mesh(mesh)
        return shard(model, init_device_mesh(ranks.device_type, (ranks.size(),), mesh_dim_names=("fsdp",)), precision)

    kind = "ddp" if strategy == "ddp" else ModelParallelStrategy(parallelize, data_parallel_size=devices,
                                                                  tensor_parallel_size=1)  # fmt: skip
    fabric = Fabric(accelerator=accelerator, devices=devices, strategy=kind)
    fabric.launch()
    return Replicas(fabric), str(fabric.device)


def keep_alive(engine: Engine) -> None:
    """Rank 0: a no-op to the other ranks every ``replicas.PING`` seconds (daemon thread)."""
    from aitraining_pl.tinker.replicas import PING

    while True:
        time.sleep(PING)
        engine.submit(engine.replicas.ping)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parser().parse_args(argv)
    if args.strategy == "fsdp2" and args.devices > 1 and args.sampler_server != "none":
        raise SystemExit(FSDP2_SERVERS)
    replicas, device = launch(args.strategy, args.devices, args.accelerator, args.precision)
    body = int(args.max_body_mb * (1 << 20))
    generation = sampler_generation(args.sampler, args.sampler_server, args.sampler_token_file, args.sampler_threads)
    if replicas is not None and replicas.rank > 0:  # sampling runs on rank 0 alone
        generation = None
    state = make_state(args.model, args.precision, device or args.device, args.checkpoint_dir, args.max_lora_rank,
                       body, args.max_tokens, args.max_datums, args.max_samples, replicas, generation)  # fmt: skip
    if replicas is not None and replicas.sharded:
        held, whole = replicas.base_share(state.engine.base)
        print(f"aitraining-pl tinker-serve: rank {replicas.rank} holds {held} of the base model's {whole} parameters "
              "(fsdp2)", flush=True)  # fmt: skip
    if replicas is not None and replicas.rank > 0:
        return replicas.follow(state.engine)
    keys = api_keys(args.api_key_file, args.checkpoint_dir)
    if replicas is not None:
        threading.Thread(target=keep_alive, args=(state.engine,), name="tinker-ping", daemon=True).start()
    print(f"aitraining-pl tinker-serve: {args.model} on http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.run(build_app(state, keys), host=args.host, port=args.port, log_level="warning")
    finally:
        if replicas is not None:
            state.engine.submit(replicas.stop).result()
        if state.sampler.served is not None:  # launched servers stop with this one
            state.sampler.served.close()


if __name__ == "__main__":
    main()
