"""The guards of an episode environment's own code: the same policy as a reward function's (``rewards``).

``reset`` and ``step`` run under ``guarded_call`` with the online modules' ``reward_timeout``. An exception,
``sys.exit`` or ``os._exit``, a call that does not return in time, or a result the protocol does not allow (a step
that is not an ``EpisodeStep``, a reward or metric that is not a finite number, a message that is not a dict with a
string ``role``) stops the run with one ``RewardError`` naming the environment, the method and the turn (the command
line prints it as one line and exits with status 2). SIGTERM while a call hangs stops the run (``CallInterrupted``).

The messages of a reply (or of ``reset``) longer than ``EpisodeLimits.max_reply_chars`` characters in all are cut
to that length, with a note of how much was cut, before the chat template renders them and the tokenizer reads
them: a runaway reply costs what a reply of that size costs, and a warning names the environment.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

from aitraining_pl.environments.episode import AssistantTurn, EpisodeEnvironment, EpisodeStep, Message
from aitraining_pl.environments.tool_worker import bounded
from aitraining_pl.errors import RewardError
from aitraining_pl.guarded_call import CallInterrupted, CallTimeout, guarded_call
from aitraining_pl.rewards import describe_failure

_EXAMPLE = "{'role': 'user', 'content': '...'}"


def _where(env: EpisodeEnvironment) -> str:
    return f"episode environment {type(env).__name__!r}"


def _call(env: EpisodeEnvironment, method: str, args: Sequence[Any], timeout: float | None) -> Any:
    """``env.<method>(*args)`` under ``guarded_call``; every failure a ``RewardError`` naming ``env``."""
    try:
        return guarded_call(getattr(env, method), args, timeout)
    except (RewardError, CallInterrupted):  # a reward source inside the environment, already named; SIGTERM
        raise
    except CallTimeout:
        raise RewardError(_where(env), f"{method} did not return within {timeout:g} s (reward_timeout)") from None
    except (Exception, SystemExit) as err:  # SystemExit (or os._exit) from an environment is an error
        raise RewardError(_where(env), f"{method} {describe_failure(err)}") from err


def _finite(env: EpisodeEnvironment, value: Any, what: str, turn: int) -> float:
    number = None
    if not isinstance(value, (str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if number is None:
        raise RewardError(_where(env), f"step returned {what} {value!r:.60} at turn {turn}, not a float")
    if not math.isfinite(number):
        raise RewardError(_where(env), f"step returned a non-finite {what} ({number}) at turn {turn}")
    return number


def checked_messages(env: EpisodeEnvironment, method: str, messages: Any, max_chars: int) -> list[Message]:
    """``messages`` checked (a list of dicts with a string ``role`` and text, a list or no ``content``) and cut
    to ``max_chars`` characters of content in all."""
    if not isinstance(messages, (list, tuple)):
        raise RewardError(_where(env), f"{method} returned messages {messages!r:.80}, not a list of {_EXAMPLE}")
    checked, room = [], max_chars
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RewardError(_where(env), f"{method} returned messages[{i}] = {message!r:.80}, not a dict {_EXAMPLE}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            kind = type(content).__name__
            raise RewardError(_where(env), f"{method} returned messages[{i}] with a {kind} content, not text")
        if isinstance(content, str):
            if len(content) > room:
                warnings.warn(
                    f"{_where(env)}: {method} returned messages longer than max_reply_chars ({max_chars} characters "
                    "in all); the rest is cut (the kept text ends with '... [N characters cut]')",
                    UserWarning,
                    stacklevel=2,
                )
                message = {**message, "content": bounded(content, max(room, 0))}
            room -= len(content)
        checked.append(message)
    return checked


def guarded_reset(env: EpisodeEnvironment, prompt: str, metadata: dict, timeout: float | None) -> list[Message] | None:
    """``env.reset(prompt, metadata)`` guarded and its messages checked (``None`` passes)."""
    messages = _call(env, "reset", (prompt, metadata), timeout)
    return None if messages is None else checked_messages(env, "reset", messages, env.limits.max_reply_chars)


def guarded_step(env: EpisodeEnvironment, turn: AssistantTurn, timeout: float | None) -> EpisodeStep:
    """``env.step(turn)`` guarded and its answer checked: finite reward and metrics, message dicts, bounded."""
    result = _call(env, "step", (turn,), timeout)
    if not isinstance(result, EpisodeStep):
        raise RewardError(_where(env), f"step returned {result!r:.80} at turn {turn.index}, not an EpisodeStep")
    if not isinstance(result.metrics, dict):
        raise RewardError(_where(env), f"step returned metrics {result.metrics!r:.80}, not a dict of floats")
    metrics = {str(k): _finite(env, v, f"metric {k!r}", turn.index) for k, v in result.metrics.items()}
    reward = _finite(env, result.reward, "reward", turn.index)
    messages = [] if result.done else checked_messages(env, "step", result.messages, env.limits.max_reply_chars)
    images = result.images if isinstance(result.images, (list, tuple)) else [result.images]
    return EpisodeStep(messages, bool(result.done), reward, metrics, [] if result.done else list(images))
