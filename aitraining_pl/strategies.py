"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` set up for FSDP2 data parallelism over every process.

Lightning's ``ModelParallelStrategy`` takes a 2-D mesh (data parallel x tensor parallel) whose defaults put every
process of a node on the tensor-parallel dimension. The modules of this project shard with FSDP2 only
(``AlignmentModule.configure_model``), so here the data-parallel size defaults to the world size and the
tensor-parallel size to 1; ``cpu_offload`` keeps the sharded parameters, gradients and optimizer states in CPU
memory. Registered with Lightning as ``fsdp2`` (and ``fsdp2_cpu_offload``): ``--trainer.strategy fsdp2`` in the CLI,
``pl.Trainer(strategy="fsdp2")`` once this module is imported (every module of the project imports it). The plain
``ModelParallelStrategy`` with ``data_parallel_size`` = processes and ``tensor_parallel_size=1`` is equivalent
(without offload).
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``num_nodes`` x ``devices``), checkpoints saved sharded (one file per rank).

    Args:
        data_parallel_size: ranks the parameters are sharded over (default: all processes).
        cpu_offload: keep sharded parameters, gradients and optimizer states in CPU memory (``CPUOffloadPolicy``).
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
        super().setup_environment()


for _name, _offload in (("fsdp2", False), ("fsdp2_cpu_offload", True)):
    if _name not in StrategyRegistry:
        StrategyRegistry.register(
            _name, FSDP2Strategy, description=f"FSDP2 over all processes (cpu_offload={_offload})", cpu_offload=_offload
        )
