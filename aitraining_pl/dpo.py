"""Deprecated seed import path: a re-export of ``aitraining_pl.compat.dpo`` that warns (``DeprecationWarning``) until
the next release."""

from aitraining_pl.compat.common import warn_moved
from aitraining_pl.compat.dpo import *  # noqa: F403
from aitraining_pl.compat.dpo import __all__  # noqa: F401

warn_moved("import aitraining_pl.dpo", "import aitraining_pl.compat.dpo", stacklevel=2)
