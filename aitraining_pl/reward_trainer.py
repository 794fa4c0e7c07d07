"""Deprecated seed import path: a re-export of ``aitraining_pl.compat.reward_trainer`` that warns
(``DeprecationWarning``) until the next release."""

from aitraining_pl.compat.common import warn_moved
from aitraining_pl.compat.reward_trainer import RewardModelTrainer

__all__ = ["RewardModelTrainer"]

warn_moved("import aitraining_pl.reward_trainer", "import aitraining_pl.compat.reward_trainer", stacklevel=2)
