"""What the seed's facades share: the ``device`` argument as Trainer options, a metrics recorder, a
checkpoint every N batches, one quiet ``Trainer.fit`` call, and the one deprecation policy of old import paths."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["accelerator_options", "MetricsHistory", "EveryNBatchesCheckpoint", "fit", "warn_moved"]


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    """The one deprecation policy of the seed's old import paths (docs/from_the_seed.md): each still works until
    the next release, with a ``DeprecationWarning`` that names the statement to use instead."""
    warnings.warn(
        f"'{old}' is deprecated and will be removed in the next release: use '{new}'",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def accelerator_options(device: str | torch.device | None) -> dict[str, Any]:
    """Trainer ``accelerator`` / ``devices`` for the seed's ``device`` argument (``None`` = auto)."""
    if device is None:
        return {"accelerator": "auto", "devices": 1}
    device = torch.device(device)
    if device.type == "cpu":
        return {"accelerator": "cpu", "devices": 1}
    return {"accelerator": "gpu" if device.type == "cuda" else device.type, "devices": [device.index or 0]}


class MetricsHistory(pl.Callback):
    """Collects ``train/*`` metrics after every training batch and ``val/*`` after every validation, as lists."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}

    def _record(self, trainer: pl.Trainer, prefix: str) -> None:
        for name, value in trainer.callback_metrics.items():
            if name.startswith(prefix):
                self.history.setdefault(name, []).append(float(value))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._record(trainer, "train/")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, "val/")


class EveryNBatchesCheckpoint(pl.Callback):
    """Saves a Lightning checkpoint every ``every`` training batches (PPO iterations / DPO batches) as
    ``<dirpath>/step-<n>.ckpt``; frozen references and reward models stay out of it (the modules exclude them)."""

    def __init__(self, dirpath: str, every: int):
        self.dirpath, self.every, self.count = dirpath, every, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.count += 1
        if self.every > 0 and self.count % self.every == 0:
            trainer.save_checkpoint(os.path.join(self.dirpath, f"step-{self.count}.ckpt"))


def fit(
    module: pl.LightningModule,
    train_loader: Any,
    val_loader: Any,
    options: dict[str, Any],
    callbacks: list[pl.Callback],
    trainer_kwargs: Mapping[str, Any],
    every: int = 0,
) -> tuple[pl.Trainer, dict[str, list[float]]]:
    """Run ``Trainer.fit`` with quiet defaults (no logger, no progress bar) that ``trainer_kwargs`` override;
    with a ``val_loader`` validated every ``every`` batches, validate once more at the end unless the last
    batch already was a validation point. Returns the trainer and the ``MetricsHistory`` lists."""
    history = MetricsHistory()
    kwargs = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **options,
        **trainer_kwargs,
    }
    kwargs["callbacks"] = [history, *callbacks, *list(kwargs.get("callbacks") or [])]
    trainer = pl.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
    if val_loader is not None and every and len(train_loader) % every:
        trainer.validate(module, dataloaders=val_loader, verbose=False)
    return trainer, history.history
