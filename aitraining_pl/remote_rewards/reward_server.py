"""A reward server over HTTP as a reward source (schema in ``aitraining_pl.remote_rewards``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aitraining_pl.errors import RewardError
from aitraining_pl.remote_rewards.transport import HTTPEndpoint, check_scores, public_url


class RemoteReward:
    """A reward server over HTTP: each call POSTs the batch's ``{prompt, completion, metadata}`` rows and reads
    ``{"scores": [...]}`` (optionally ``"components"``); schema, retries and secrets in the module docstring.

    Args:
        url: the server's scoring endpoint (``http://`` or ``https://``).
        timeout, retries, backoff, headers: as ``HTTPEndpoint``'s (defaults 30 s, 2 retries, 0.5 s, none).
    """

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.5,
        headers: Mapping[str, Any] | None = None,
    ):
        self.endpoint = HTTPEndpoint(url, timeout, retries, backoff, headers, name="remote reward")
        self.last_components: dict[str, list[float | None]] = {}

    def __repr__(self) -> str:
        return f"RemoteReward({public_url(self.endpoint.url)!r})"

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
        rows = [
            {"prompt": p, "completion": r, "metadata": dict(m or {})} for p, r, m in zip(prompts, responses, metadata)
        ]
        answer = self.endpoint.post({"rows": rows})
        where = self.endpoint.where
        if not isinstance(answer, dict) or "scores" not in answer:
            raise RewardError(where, f'the answer has no "scores": {self.endpoint.quote(json.dumps(answer))}')
        scores = check_scores(where, answer["scores"], len(rows))
        components = answer.get("components") or {}
        if not isinstance(components, dict):
            raise RewardError(where, f'the answer\'s "components" is a {type(components).__name__}, not an object')
        self.last_components = {
            str(name): check_scores(where, values, len(rows), f"components.{name}", allow_none=True)
            for name, values in components.items()
        }
        return scores
