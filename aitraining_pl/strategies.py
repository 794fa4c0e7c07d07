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

With ``sequence_parallel_size`` P > 1 the mesh is (data parallel = processes / P) x (sequence parallel = P), named
``("data_parallel", "sequence_parallel")``: the P ranks of a sequence-parallel group read the same batches (the
sampler follows the data-parallel dimension) and split each packed row between them (Ulysses,
``models.sequence_parallel``), and FSDP2 shards over every rank (``sharding_mesh``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

from aitraining_pl.errors import ConfigError
from aitraining_pl.models import sequence_parallel


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``num_nodes`` x ``devices``), checkpoints saved sharded (one file per rank).

    Args:
        data_parallel_size: ranks the parameters are sharded over (default: all processes).
        cpu_offload: keep sharded parameters, gradients and optimizer states in CPU memory (``CPUOffloadPolicy``);
            the process group then has a gloo side for the host tensors (``with_cpu_side``).
        save_distributed_checkpoint: save each rank's shard (``True``, the default) or one full checkpoint file
            written by rank 0.
        sequence_parallel_size: ranks each packed row is split over (Ulysses sequence parallelism, Jacobs et al.
            2023): activations per rank shrink by this factor for rows too long for one device; it must divide the
            number of processes and the model's query and key/value heads (1: off).
        kwargs: other ``ModelParallelStrategy`` arguments (``process_group_backend``, ``timeout``).
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        sequence_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.cpu_offload = cpu_offload
        if int(sequence_parallel_size) < 1:
            raise ConfigError(sequence_parallel.OPTION, f"must be at least 1, got {sequence_parallel_size}")
        self.sequence_parallel_size = int(sequence_parallel_size)

    def setup_environment(self) -> None:
        processes, size = self.num_nodes * self.num_processes, self.sequence_parallel_size
        if processes % size:
            raise ConfigError(
                sequence_parallel.OPTION, f"sequence_parallel_size {size} does not divide the {processes} processes"
            )
        if self._data_parallel_size == "auto":
            self._data_parallel_size = processes
        elif size > 1 and self._data_parallel_size * size != processes:
            raise ConfigError(
                sequence_parallel.OPTION,
                f"data_parallel_size {self._data_parallel_size} x sequence_parallel_size {size} must equal the "
                f"{processes} processes",
            )
        if size > 1:
            self._data_parallel_size = processes  # Lightning's (data, tensor) mesh first; replaced below
        if self.cpu_offload:
            self._process_group_backend = with_cpu_side(self._process_group_backend, self.root_device.type)
        super().setup_environment()
        if size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(
                self.root_device.type, (processes // size, size), mesh_dim_names=("data_parallel", "sequence_parallel")
            )
            self._data_parallel_size = processes // size
            self.lightning_module._device_mesh = self._device_mesh
            sequence_parallel.set_group(self._device_mesh["sequence_parallel"].get_group())

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        policy = getattr(self.lightning_module, "policy", None)
        if self.sequence_parallel_size > 1 and isinstance(policy, torch.nn.Module):
            check_sequence_parallel(policy, self.sequence_parallel_size)

    def teardown(self) -> None:
        sequence_parallel.set_group(None)
        super().teardown()


def check_sequence_parallel(model: torch.nn.Module, size: int) -> None:
    """Before training, a clear error where ``model`` cannot split its rows over ``size`` ranks: heads that do not
    divide, an attention that cannot run packed (``models.sequence_parallel.check_model``), or one that does not go
    through transformers' ``AttentionInterface``, so the Ulysses wrapper would never run: the scoring probe
    (``models.scoring.scoring_path``) runs the split path on every rank of the group against the model's own
    forward. Every rank of the group must call it."""
    from aitraining_pl.models.scoring import scoring_path

    sequence_parallel.check_model(model, size)
    path = scoring_path(model)
    if not path.packed:
        raise ConfigError(
            sequence_parallel.OPTION,
            f"{type(model).__name__}: its attention cannot be wrapped for sequence parallelism ({path.reason}); "
            "use sequence_parallel_size 1",
        )


def sharding_mesh(mesh: Any) -> Any:
    """The 1-D mesh FSDP2 shards over: the ``data_parallel`` dimension of Lightning's mesh, or, with a
    ``sequence_parallel`` dimension, every rank (data x sequence, flattened): the ranks of a sequence-parallel
    group hold different shards, and the gradients are averaged over all ranks (``models.sequence_parallel``)."""
    names = mesh.mesh_dim_names or ()
    if "sequence_parallel" in names:
        return mesh._flatten("data_sequence_parallel") if mesh.ndim > 1 else mesh
    return mesh["data_parallel"] if "data_parallel" in names else mesh


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
