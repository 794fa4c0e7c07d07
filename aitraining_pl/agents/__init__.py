"""Train agents we do not control: an OpenAI-compatible endpoint that records every call token-in / token-out
(``endpoint.AgentEndpoint``), and ``environment.AgentEnvironment``, which plays a user's ``agent(client, prompt,
metadata) -> reward`` through it and trains on what was sampled (docs/agents.md).

Needs the ``agents`` extra (FastAPI, uvicorn, openai): ``pip install 'aitraining-pl[agents]'``. The package imports
without it; building an endpoint without it raises one line naming the extra."""

from __future__ import annotations

# Lightning before pydantic / openai: Python caches ``typing.Union`` by its members, so a ``Union[float, int]`` built
# by those packages before Lightning is imported becomes the type of ``Trainer(limit_train_batches=...)``, and the CLI
# then reads ``--trainer.limit_train_batches 1`` as 1.0 (every batch) instead of one batch
import lightning.pytorch  # noqa: F401, E402  (isort: skip)

from aitraining_pl.agents.endpoint import EXTRA_HINT, AgentEndpoint, require_agents_extra
from aitraining_pl.agents.environment import AgentEnvironment
from aitraining_pl.agents.recording import CallRecord, TokenSequence, split_sequences
from aitraining_pl.agents.rows import episode_rows

__all__ = [
    "EXTRA_HINT",
    "AgentEndpoint",
    "AgentEnvironment",
    "CallRecord",
    "TokenSequence",
    "episode_rows",
    "require_agents_extra",
    "split_sequences",
]
