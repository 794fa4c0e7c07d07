"""Seed import path kept as a re-export: the code is in ``aitraining_pl.compat.facades``."""

from aitraining_pl.compat.facades import *  # noqa: F403
from aitraining_pl.compat.facades import __all__  # noqa: F401
