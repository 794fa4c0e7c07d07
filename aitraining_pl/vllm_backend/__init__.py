"""Deprecated: the generation side is laid out by role (docs/architecture.md). This package stays for one release as
a re-export that warns: ``aitraining_pl.vllm_backend`` and each of its old submodules are the module that now holds
their code, and importing one warns once (``DeprecationWarning``) naming the new module.

=========================================  =========================================================
old                                        new
=========================================  =========================================================
``vllm_backend``                           ``generation.config`` (``VLLMConfig``, ``EXTRA_CPU``, ...)
``vllm_backend.engine``                    ``generation.vllm`` (the colocated engine)
``vllm_backend.client``                    ``generation.servers.client``
``vllm_backend.weight_group``              ``generation.servers.weights``
``vllm_backend.hf_engine``                 ``generation.servers.hf_server``
``vllm_backend.launched``                  ``generation.servers.launcher``
``vllm_backend.serve``                     ``generation.servers.serve``
``vllm_backend.wire`` / ``server`` / ...   ``generation.servers.tcp_wire`` / ``tcp_server`` / ...
=========================================  =========================================================
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

from aitraining_pl.generation.config import EXTRA_CPU, EXTRA_GPU, VLLMConfig

__all__ = ["EXTRA_CPU", "EXTRA_GPU", "VLLMConfig"]

#: each old submodule -> the module that now holds its code
MOVED = {
    "engine": "aitraining_pl.generation.vllm",
    "client": "aitraining_pl.generation.servers.client",
    "weight_group": "aitraining_pl.generation.servers.weights",
    "hf_engine": "aitraining_pl.generation.servers.hf_server",
    "launched": "aitraining_pl.generation.servers.launcher",
    "serve": "aitraining_pl.generation.servers.serve",
    "wire": "aitraining_pl.generation.servers.tcp_wire",
    "server": "aitraining_pl.generation.servers.tcp_server",
    "guards": "aitraining_pl.generation.servers.tcp_guards",
    "batching": "aitraining_pl.generation.servers.tcp_batching",
}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: import {new} instead",
        DeprecationWarning,
        stacklevel=3,
    )


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import aitraining_pl.vllm_backend.<old>`` with the module now holding its code (``MOVED``)."""

    def __init__(self) -> None:
        self.specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED[spec.name.rpartition(".")[2]]
        _deprecated(spec.name, new)
        module = importlib.import_module(new)
        self.specs[module.__name__] = module.__spec__  # the import machinery sets the old name's spec on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed: only its own spec is put back."""
        module.__spec__ = self.specs.pop(module.__name__, module.__spec__)


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())

_deprecated(__name__, "aitraining_pl.generation (generation.config, generation.vllm, generation.servers)")
