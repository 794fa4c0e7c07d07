"""Checkpoints written beside their target, never through ``/tmp``.

Lightning's ``TorchCheckpointIO`` writes a local checkpoint through an fsspec transaction, which stages the file
with ``tempfile.mkstemp()`` in the system temporary folder and then moves (copies, across file systems) it into
place: a run killed during the write leaves a checkpoint-sized file in ``/tmp``, and ``/tmp`` must hold it.
``AtomicCheckpointIO`` writes ``<dir>/.<name>.tmp-<pid>-<random>`` next to the target, flushes it to disk and
renames it over the target in one step, so the target is either the old or the new complete file. Temporary
files of killed runs (their pid is gone) are removed when the next fit starts.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

_LEFTOVER = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]{8}$")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are written next to the target and renamed into place (remote
    URLs are left to Lightning)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        text = str(path)
        if "://" in text and not text.startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(text.removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_checkpoint_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that killed runs (pid gone) left in ``folder``; returns them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if (m := _LEFTOVER.match(p.name)) and p.is_file() and not _alive(int(m[1]))]
    for path in found:
        path.unlink(missing_ok=True)
    return found


def use_atomic_checkpoints(trainer: pl.Trainer) -> None:
    """Give ``trainer`` an ``AtomicCheckpointIO`` when it has Lightning's plain ``TorchCheckpointIO`` (another
    plugin is kept), and remove the leftovers of killed runs in its checkpoint folders."""
    strategy = trainer.strategy
    if type(getattr(strategy, "checkpoint_io", None)) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    if trainer.is_global_zero:
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None):
                remove_checkpoint_leftovers(callback.dirpath)
