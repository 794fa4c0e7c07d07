"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` set up for FSDP2 data parallelism over every process.

Lightning's ``ModelParallelStrategy`` takes a 2-D mesh (data parallel x tensor parallel) whose defaults put every
process of a node on the tensor-parallel dimension. The modules of this project shard with FSDP2 only
(``AlignmentModule.configure_model``), so here the data-parallel size defaults to the world size and the
tensor-parallel size to 1; ``cpu_offload`` keeps the sharded parameters, gradients and optimizer states in CPU
memory, and then the process group gets a CPU side (``cpu:gloo,cuda:nccl``: Lightning starts NCCL alone, and the
all-reduce of the gradient norm and any gather of the host shards need gloo). Registered with Lightning as
``fsdp2`` (and ``fsdp2_cpu_offload``): ``--trainer.strategy fsdp2`` in the CLI, ``pl.Trainer(strategy="fsdp2")``
once this module is imported (every module of the project imports it). The plain ``ModelParallelStrategy`` with
``data_parallel_size`` = processes and ``tensor_parallel_size=1`` is equivalent (without offload).
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``num_nodes`` x ``devices``), checkpoints saved sharded (one file per rank).

    Args:
        data_parallel_size: ranks the parameters are sharded over (default: all processes).
        cpu_offload: keep sharded parameters, gradients and optimizer states in CPU memory (``CPUOffloadPolicy``);
            the process group then has a gloo side for the host tensors (``with_cpu_side``).
        save_distributed_checkpoint: save each rank's shard (``True``, the default) or one full checkpoint file
            written by rank 0.
        kwargs: other ``ModelParallelStrategy`` arguments (``process_group_backend``, ``timeout``).
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.cpu_offload = cpu_offload

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self.cpu_offload:
            self._process_group_backend = with_cpu_side(self._process_group_backend, self.root_device.type)
        super().setup_environment()


def with_cpu_side(backend: str | None, device_type: str) -> str | None:
    """The process-group backend for shards offloaded to CPU memory on a ``device_type`` accelerator: the given
    one (``None``: the device's default, ``nccl`` on CUDA) with a gloo side for CPU tensors, e.g.
    ``cpu:gloo,cuda:nccl``. On a CPU (gloo already) or when the backend names a CPU side, it is kept."""
    if device_type == "cpu" or (backend is not None and (backend == "gloo" or "cpu:" in backend)):
        return backend
    backend = backend or ("nccl" if device_type == "cuda" else None)
    if backend is None:  # another accelerator: its own default, told to Lightning by name
        from torch.distributed import Backend

        backend = Backend.default_device_backend_map.get(device_type, "gloo")
    return "cpu:gloo," + (backend if ":" in backend else f"{device_type}:{backend}")


for _name, _offload in (("fsdp2", False), ("fsdp2_cpu_offload", True)):
    if _name not in StrategyRegistry:
        StrategyRegistry.register(
            _name, FSDP2Strategy, description=f"FSDP2 over all processes (cpu_offload={_offload})", cpu_offload=_offload
        )
