"""Deprecated seed import path: a re-export of ``aitraining_pl.compat.facades`` that warns
(``DeprecationWarning``) until the next release."""

from aitraining_pl.compat.common import warn_moved
from aitraining_pl.compat.facades import *  # noqa: F403
from aitraining_pl.compat.facades import __all__  # noqa: F401

warn_moved("import aitraining_pl.facades", "import aitraining_pl.compat.facades", stacklevel=2)
