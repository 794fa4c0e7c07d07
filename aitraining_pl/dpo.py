"""Seed import path kept as a re-export: the code is in ``aitraining_pl.compat.dpo``."""

from aitraining_pl.compat.dpo import *  # noqa: F403
from aitraining_pl.compat.dpo import __all__  # noqa: F401
