"""The seed's ``autotrain.trainers.rl.environments`` import path. The environments are core components
(``aitraining_pl.environments``, usable as reward sources by the RL modules); this module re-exports them."""

from __future__ import annotations

from aitraining_pl.environments import *  # noqa: F403
from aitraining_pl.environments import __all__  # noqa: F401
