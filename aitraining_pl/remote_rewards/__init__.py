"""Reward sources behind HTTP: a reward server (``RemoteReward``) and an LLM judge (``JudgeReward``).

Both follow the reward-source protocol of ``aitraining_pl.rewards`` and are named in YAML through
``build_reward_source``: a dict with ``url`` is a ``RemoteReward``, a dict with ``base_url`` a ``JudgeReward``.

**Reward server schema.** ``RemoteReward`` POSTs one JSON request per call of the source (one rollout batch)::

    {"rows": [{"prompt": "...", "completion": "...", "metadata": {...}}, ...]}

and expects HTTP 200 with ``{"scores": [s_0, s_1, ...]}``: one finite number per row, in order. The answer may add
``"components": {"name": [c_0, ...]}`` (numbers or ``null``, one per row), logged as ``train/reward/<name>``.

**Transport** (``HTTPEndpoint``, shared by both). Each request waits at most ``timeout`` seconds for the server (a
socket timeout: per connect and per read). A connection error, a timeout, an HTTP 5xx or 429 is retried up to
``retries`` times, after ``backoff``, ``2 * backoff``, ``4 * backoff``, ... seconds; any other 4xx is not retried.
Header values may name environment variables, ``${ENV_NAME}``, expanded when the source is built (an unset one is
an error then): the config and the run's hyperparameters keep ``${ENV_NAME}``, never the secret, and no error
message or ``repr`` shows a header value (a server's answer quoted in an error has them replaced by ``***``).
URLs in messages drop any ``user:password@``, query and fragment.

Every failure is one ``RewardError`` line naming the endpoint, e.g. ``remote reward http://host:8000/score: HTTP 503
after 3 attempts (retries: 2): <answer>``; the run stops before the batch is trained on. The online modules call a
source under ``reward_timeout`` (default 600 s): keep ``(retries + 1) * timeout`` and the backoff below it, or that
timeout fires first.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from aitraining_pl.errors import RewardError
from aitraining_pl.remote_rewards.judge import DEFAULT_JUDGE_TEMPLATE, JudgeReward, parse_judge_score
from aitraining_pl.remote_rewards.reward_server import RemoteReward
from aitraining_pl.remote_rewards.transport import HTTPEndpoint, check_scores, expand_headers, public_url

__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "HTTPEndpoint",
    "JudgeReward",
    "RemoteReward",
    "build_remote_source",
    "check_scores",
    "expand_headers",
    "parse_judge_score",
    "public_url",
]


def build_remote_source(spec: Mapping[str, Any]) -> RemoteReward | JudgeReward:
    """The source a YAML dict describes: ``{url: ...}`` -> ``RemoteReward``, ``{base_url: ...}`` ->
    ``JudgeReward``; the dict's other keys are their arguments.

    Raises:
        RewardError: an option that the source does not take (listing the ones it does), or a bad value.
    """
    cls = RemoteReward if "url" in spec else JudgeReward
    options = [p for p in inspect.signature(cls).parameters]
    unknown = sorted(set(spec) - set(options))
    if unknown:
        key = "url" if cls is RemoteReward else "base_url"
        where = f"reward {{{key}: {public_url(str(spec[key]))}}}"
        raise RewardError(
            where, f"unknown option {unknown[0]!r} for {cls.__name__}; the options are {', '.join(options)}"
        )
    missing = [
        p.name for p in inspect.signature(cls).parameters.values() if p.default is p.empty and p.name not in spec
    ]
    if missing:
        raise RewardError(f"reward {{{', '.join(spec)}}}", f"{cls.__name__} needs {missing[0]!r}")
    return cls(**spec)
