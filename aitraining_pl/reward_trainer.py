"""Seed import path kept as a re-export: the code is in ``aitraining_pl.compat.reward_trainer``."""

from aitraining_pl.compat.reward_trainer import RewardModelTrainer

__all__ = ["RewardModelTrainer"]
