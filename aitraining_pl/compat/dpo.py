"""The seed's ``autotrain.trainers.rl.dpo`` import path: ``from aitraining_pl.compat.dpo import PreferenceDataset``.

Re-exports only; the code lives in ``aitraining_pl.datamodules.preference`` (data), ``aitraining_pl.modules.dpo``
(the LightningModule) and ``aitraining_pl.compat.facades`` (the seed's ``DPOConfig`` / ``DPOTrainer``).
"""

from __future__ import annotations

from typing import Any

from aitraining_pl.datamodules.preference import PreferenceCollator, PreferenceDataModule, PreferenceDataset
from aitraining_pl.modules.dpo import DPOModule


def __getattr__(name: str) -> Any:
    # the facades import Lightning's Trainer machinery; load them only when asked for
    if name in ("DPOConfig", "DPOTrainer"):
        from aitraining_pl.compat import facades

        return getattr(facades, name)
    raise AttributeError(f"module 'aitraining_pl.compat.dpo' has no attribute {name!r}")


__all__ = [  # noqa: F822 - DPOConfig / DPOTrainer load lazily (__getattr__)
    "PreferenceDataset",
    "PreferenceDataModule",
    "PreferenceCollator",
    "DPOModule",
    "DPOConfig",
    "DPOTrainer",
]
