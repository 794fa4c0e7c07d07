"""The rollout side: the one rollout engine (``rollout.engine``: prompts in; responses, masks, ended flags and
texts out, ``G`` samples per prompt), what a rollout is (``rollout.batch``: ``Rollout``, and ``RolloutBatch``, the
scored rows the modules train on) and the asynchronous pipeline that asks a generation server ahead
(``rollout.asynchronous``). ``from aitraining_pl.rollout import X`` reaches what the engine module holds, and the
backend registry and factory (``generation.registry``) it builds backends with."""

from __future__ import annotations

from typing import Any

from aitraining_pl.generation.backend import BackendContext, GenerationBackend, SampledTokens, StopRule
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.hf.backend import HFBackend
from aitraining_pl.generation.registry import BACKEND_NAMES, BACKENDS, build_backend, resolve_backend, vllm_available
from aitraining_pl.rollout.batch import Rollout, RolloutBatch
from aitraining_pl.rollout.engine import (
    RolloutEngine,
    decode_responses,
    end_token_ids,
    response_mask,
    score_rollout,
    warn_truncated_sampling,
)

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "BackendContext",
    "GenerationBackend",
    "GenerationConfig",
    "HFBackend",
    "Rollout",
    "RolloutBatch",
    "RolloutEngine",
    "SampledTokens",
    "StopRule",
    "build_backend",
    "decode_responses",
    "end_token_ids",
    "resolve_backend",
    "response_mask",
    "score_rollout",
    "vllm_available",
    "warn_truncated_sampling",
]

#: backends this package named before the registry became lazy: imported when first asked for
_LAZY = {
    "VLLMEngine": "aitraining_pl.generation.vllm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
