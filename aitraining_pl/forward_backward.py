"""Deprecated seed import path: a re-export of ``aitraining_pl.compat.forward_backward`` (its submodules stay
importable under this name too) that warns (``DeprecationWarning``) until the next release."""

import sys

from aitraining_pl.compat import forward_backward as _package
from aitraining_pl.compat.common import warn_moved
from aitraining_pl.compat.forward_backward import *  # noqa: F403
from aitraining_pl.compat.forward_backward import __all__, client, losses, pipeline, sampling  # noqa: F401

for _name in ("client", "losses", "pipeline", "sampling"):
    sys.modules[f"{__name__}.{_name}"] = getattr(_package, _name)

warn_moved("import aitraining_pl.forward_backward", "import aitraining_pl.compat.forward_backward", stacklevel=2)
