"""Train agents we do not control: an OpenAI-compatible endpoint that records every call token-in / token-out
(``endpoint.AgentEndpoint``), and ``environment.AgentEnvironment``, which plays a user's ``agent(client, prompt,
metadata) -> reward`` through it and trains on what was sampled (docs/agents.md).

Needs the ``agents`` extra (FastAPI, uvicorn, openai): ``pip install 'aitraining-pl[agents]'``. The package imports
without it; building an endpoint without it raises one line naming the extra."""

from __future__ import annotations

from aitraining_pl.agents.endpoint import EXTRA_HINT, AgentEndpoint, require_agents_extra
from aitraining_pl.agents.environment import AgentEnvironment, episode_rows
from aitraining_pl.agents.recording import CallRecord, TokenSequence, split_sequences

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
