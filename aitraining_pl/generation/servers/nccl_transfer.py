"""The GPU weight path of ``HTTPReplica.push``: vLLM's own NCCL weight-transfer engine, driven over the server's RL
routes with the run's token (vLLM's ``HTTPVLLMWeightSyncClient`` sends none).

The server runs with ``--weight-transfer-config '{"backend": "nccl"}'``. At the first push the trainer's rank 0
opens a TCP store on a free port and joins an NCCL group of ``1 + the server's world size`` (``/get_world_size``)
as its rank 0 while the server's workers join through ``/init_weight_transfer_engine``; each push is then
``/start_weight_update``, ``/update_weights`` (names, dtypes, shapes) while the tensors are broadcast, and
``/finish_weight_update`` (vLLM's ``NCCLTrainerWeightTransferEngine.send_weights``). Needs vLLM in the trainer's
environment and GPUs on both sides. vLLM's receiving side does not run this project's push checks (``checks``): on
this path the names and shapes are vLLM's to refuse. Not run in CI (no GPU there)."""

from __future__ import annotations

import os
from typing import Any

import torch

from aitraining_pl.generation.servers.start import free_port


def send_weights(replica: Any, engine: Any, weights: list[tuple[str, torch.Tensor]], version: str) -> tuple[Any, int]:
    """Push ``weights`` (CUDA tensors) to ``replica``'s server as ``version`` through ``engine`` (vLLM's NCCL
    trainer engine; opened here when None): the engine and the bytes sent."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    class Source(WeightSource):
        def metadata(self) -> list[Any]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in weights]

        def __iter__(self):
            return iter(weights)

    class Client:
        """vLLM's weight-sync client over ``replica.call`` (the token, one-line errors)."""

        def _post(self, route: str, body: dict | None = None) -> None:
            replica.call("POST", f"/{route}", f"{route.replace('_', ' ')} (NCCL weights)", json=body)

        def init_weight_transfer_engine(self, init_info: dict) -> None:
            self._post("init_weight_transfer_engine", {"init_info": init_info})

        def shutdown_weight_transfer_engine(self) -> None:
            self._post("shutdown_weight_transfer_engine")

        def start_weight_update(self) -> None:
            self._post("start_weight_update")

        def update_weights(self, update_info: Any) -> None:
            self._post("update_weights", {"update_info": update_info})

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            self._post("finish_weight_update", {"weight_version": weight_version})

    if engine is None:
        world = int(replica.call("GET", "/get_world_size", "reading the server's world size")["world_size"])
        # rank 0's address as the server sees it: node 0's (``MASTER_ADDR`` of a multi-node run), else this machine
        address = os.environ.get("AITRAINING_PL_WEIGHT_ADDRESS") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        info = NCCLTrainerInitInfo(address, free_port(""), 1 + world, rank=0)  # every interface
        engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=Client(), source=Source())
    engine.source = Source()
    engine.send_weights()  # ends with /finish_weight_update; the version is named by ``HTTPReplica.push``
    return engine, sum(t.numel() * t.element_size() for _, t in weights)
