"""What an exact resume needs beyond Lightning's own checkpoint contents (model, optimizer, scheduler, loops,
callbacks, stateful dataloaders): the global random states, and the training loader's position when Lightning
set the loader up before the checkpoint was read."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch


def collect_rng_states() -> dict[str, Any]:
    """The global random states of Python, NumPy, torch (CPU) and CUDA (when initialised), as tensors, ints
    and tuples only (checkpoints load with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``collect_rng_states`` returned."""
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ExactResumeCallback(pl.Callback):
    """Saves the global random states in every checkpoint and puts them back just before the first training
    batch after a resume; validation runs on a forked random stream, so it never shifts training's.

    It also hands the saved loader positions to the training loader when Lightning would drop them: with
    ``max_epochs`` (no ``max_steps``), ``configure_optimizers`` reading ``trainer.estimated_stepping_batches``
    builds the training loader before the checkpoint is read, and the fit loop then never loads the states
    (Lightning 2.6). ``ResumableDataLoader`` starts its pass lazily, so loading them at ``on_train_start``
    is in time.

    ``AlignmentModule`` adds one to every fit (``configure_callbacks``) unless the trainer has one. Random
    states are per process: under ``torch.distributed`` every rank's states are gathered into the checkpoint
    and each rank gets its own back (resumed on another number of ranks, each starts from rank 0's).

    When fit starts it also gives the trainer ``AtomicCheckpointIO`` (``aitraining_pl.callbacks.checkpoint_io``):
    checkpoints are written beside their target and renamed into place, never staged in ``/tmp``, and the
    temporary files of killed runs are removed.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._outside_validation: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # called on every rank while the checkpoint is written: the states the next training batch would start from
        states = self._outside_validation or collect_rng_states()
        state: dict[str, Any] = {"rng_states": states}
        if _world_size() > 1:  # rank 0 writes the file: it holds every rank's states
            per_rank: list[Any] = [None] * _world_size()
            torch.distributed.all_gather_object(per_rank, states)
            state["rng_states_per_rank"] = per_rank
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per_rank = state_dict.get("rng_states_per_rank")
        if per_rank and len(per_rank) == _world_size():
            self._pending = per_rank[torch.distributed.get_rank()]
        else:  # another world size: every rank continues from rank 0's states
            self._pending = state_dict.get("rng_states")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Checkpoints are written beside their target (``AtomicCheckpointIO``), never staged in ``/tmp``."""
        from aitraining_pl.callbacks.checkpoint_io import use_atomic_checkpoints

        if stage == "fit":
            use_atomic_checkpoints(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop
        states = getattr(loop, "_combined_loader_states_to_load", None)
        if states and getattr(loop, "_combined_loader", None) is not None:
            loop._combined_loader._load_state_dicts(states)
            loop._combined_loader_states_to_load = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._outside_validation = collect_rng_states()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._outside_validation is not None:
            set_rng_states(self._outside_validation)
            self._outside_validation = None
