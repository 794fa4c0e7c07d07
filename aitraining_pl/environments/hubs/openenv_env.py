"""OpenEnv environments (PyPI ``openenv-core`` >= 0.3) played as episodes.

An OpenEnv environment follows the Gym API over typed models: ``reset(**kwargs)`` returns an ``Observation``,
``step(action)`` takes an ``Action`` (a pydantic model, e.g. ``GuessAction(guess=3)``) and returns the next
``Observation``, which carries ``done`` and ``reward`` (the environment's ``rubric``, if any, sets it in ``step``). It
runs in-process (an ``Environment``) or behind its server, reached with an ``EnvClient`` (WebSocket, async; ``.sync()``
for blocking calls), whose ``reset`` / ``step`` return a ``StepResult(observation, reward, done)``.

``OpenEnvEnvironment`` plays one OpenEnv episode per episode of this library. What maps to what:

- ``reset``: the environment is reset with ``metadata[reset_key]`` as keyword arguments (e.g. ``{"seed": 3}``); the
  first message is the data module's prompt followed by the observation's text;
- each assistant turn is parsed into the ``Action``: a JSON object gives its fields, any other text is the value of
  the action's one required field (``{"guess": "3"}``, validated by the model); text that does not validate is
  answered with an ``error: ...`` message (metric ``invalid_actions``) and no step;
- the observation after a step is the reply (its one field as text, several as JSON; ``done``, ``reward`` and
  ``metadata`` left out); ``done`` ends the episode;
- rewards: each step's ``reward`` is that turn's reward (``None`` counts 0), so the episode's return is the sum of
  OpenEnv's per-step rewards (a rubric that scores only the last step gives a final reward);
- the environment (or client) is closed when the episode ends; one cut by a limit is closed when it is dropped.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import typing
import weakref
from collections.abc import Callable
from typing import Any

from aitraining_pl.environments.episode import AssistantTurn, EpisodeEnvironment, EpisodeLimits, EpisodeStep, Message
from aitraining_pl.environments.hubs.common import require, run_sync

_WHO = "OpenEnvEnvironment"
_FIELDS_LEFT_OUT = {"done", "reward", "metadata"}


def _factory(openenv, env: Any) -> Callable[[], Any]:
    """A function making one episode's environment or client from ``env`` (see ``OpenEnvEnvironment``)."""
    if _is_url(env):
        return functools.partial(openenv.GenericEnvClient, base_url=env)
    if isinstance(env, str):
        from aitraining_pl.rewards import import_object

        env = import_object(env)
    core = openenv.core
    if isinstance(env, core.Environment):
        return functools.partial(copy.deepcopy, env)
    if isinstance(env, (core.EnvClient, core.SyncEnvClient)):
        raise TypeError(f"{_WHO}: a client holds one session; pass a function that connects one per episode")
    if not callable(env):
        raise TypeError(f"{_WHO}: env must be an OpenEnv Environment, a factory, a server URL or an import path")
    return env


def _is_url(env: Any) -> bool:
    return isinstance(env, str) and env.startswith(("http://", "https://", "ws://", "wss://"))


def _action_type(openenv, env: Any) -> type | None:
    """The ``Action`` class among the generic parameters of ``env``'s class (``Environment[MyAction, ...]``,
    ``EnvClient[MyAction, ...]``); None when it takes plain dicts (``GenericEnvClient``)."""
    target = env.async_client if isinstance(env, openenv.core.SyncEnvClient) else env
    for cls in type(target).__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if inspect.isclass(arg) and issubclass(arg, openenv.core.Action):
                    return arg
    return None


def parse_action(text: str, action_type: type | None, schema: dict | None = None) -> Any:
    """The model's turn as an action: a JSON object's fields, else the text as the value of the action's one required
    field (``action_type``'s, or the JSON ``schema``'s of a client that takes dicts); an ``Action`` validated by
    pydantic, or a dict. ``ValueError`` when it does not fit."""
    text = text.strip()
    try:
        fields = json.loads(text)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        schema = action_type.model_json_schema() if action_type is not None else schema or {}
        required = [name for name in schema.get("required", []) if name != "metadata"]
        if len(required) != 1:
            raise ValueError(f"not a JSON object of the action's fields {sorted(schema.get('properties', {}))}")
        fields = {required[0]: text}
    return fields if action_type is None else action_type.model_validate(fields)


def server_action_schema(url: str) -> dict:
    """The action's JSON schema, from a running OpenEnv server's ``GET /schema``."""
    import urllib.request

    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    with urllib.request.urlopen(f"{http}/schema", timeout=30) as response:  # noqa: S310 - the user's server URL
        return json.loads(response.read())["action"]


def observation_text(observation: Any) -> str:
    """An observation as the text of a message: its one field as text, several as JSON (without ``done``,
    ``reward`` and ``metadata``)."""
    fields = observation if isinstance(observation, dict) else observation.model_dump(mode="json")
    fields = {k: v for k, v in fields.items() if k not in _FIELDS_LEFT_OUT}
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(fields, ensure_ascii=False) if fields else ""


class ActionRefused(Exception):
    """An OpenEnv server refused an action (``VALIDATION_ERROR``): answered to the model as an invalid action."""


class OpenEnvEnvironment(EpisodeEnvironment):
    """An OpenEnv environment as an episode environment (see the module docstring for what maps to what).

    Args:
        env: an OpenEnv ``Environment`` (copied for each episode); a function (or class) making one ``Environment``,
            ``EnvClient`` or ``SyncEnvClient`` per episode, or a coroutine of one (``EnvClient.from_env``); an import
            path ``"pkg.module:object"`` of either; or a running server's URL (``"http://host:port"``, played through
            a ``GenericEnvClient``).
        action_type: the ``Action`` class the model's turns are parsed into; default: the environment's or client's
            own (its generic parameters), plain dicts for a ``GenericEnvClient``.
        reset_key: metadata key holding ``reset``'s keyword arguments (a dict, e.g. ``{"seed": 3}``).
        max_turns: assistant turns (steps) per episode.
        max_total_tokens: tokens after the prompt per episode.
        reply_role: role of the observation messages.
    """

    def __init__(
        self,
        env: Any,
        action_type: type | str | None = None,
        reset_key: str = "reset",
        max_turns: int = 8,
        max_total_tokens: int = 1 << 16,
        reply_role: str = "user",
    ):
        self.openenv = require("openenv", "openenv", _WHO)
        self.make = _factory(self.openenv, env)
        if isinstance(action_type, str):
            from aitraining_pl.rewards import import_object

            action_type = import_object(action_type)
        self.action_type, self.reset_key, self.reply_role = action_type, reset_key, reply_role
        self.url, self.schema = (env if _is_url(env) else None), {}  # the server's action schema, read once
        self.limits = EpisodeLimits(max_turns=max_turns, max_total_tokens=max_total_tokens)

    def spawn(self) -> OpenEnvEnvironment:
        return copy.copy(self)  # the episode's environment is made in reset

    def reset(self, prompt: str, metadata: dict) -> list[Message]:
        kwargs = metadata.get(self.reset_key) or {}
        if not isinstance(kwargs, dict):
            raise ValueError(f"{_WHO}: metadata {self.reset_key!r} must be a dict of reset's arguments, got {kwargs!r}")
        self.env = self.make()
        if inspect.isawaitable(self.env):  # e.g. `lambda: MyEnvClient.from_env("owner/env")`
            self.env = run_sync(self.env)
        self.kind = self.action_type or _action_type(self.openenv, self.env)
        if self.kind is None and self.url and not self.schema:
            self.schema.update(server_action_schema(self.url))
        self.close = weakref.finalize(self, _close, self.env)  # also when an episode cut by a limit is dropped
        observation, _, _ = self._call("reset", **kwargs)
        text = observation_text(observation)
        return [{"role": "user", "content": f"{prompt}\n\n{text}" if prompt and text else prompt or text}]

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        try:
            action = parse_action(turn.text, self.kind, self.schema)
        except ValueError as err:  # pydantic's ValidationError included
            return self._invalid(err)
        try:
            observation, reward, done = self._call("step", action)
        except ActionRefused as err:
            return self._invalid(err)
        reward = 0.0 if reward is None else float(reward)
        if done:
            self.close()
            return EpisodeStep(done=True, reward=reward, metrics={"invalid_actions": 0.0})
        reply = [{"role": self.reply_role, "content": observation_text(observation)}]
        return EpisodeStep(reply, reward=reward, metrics={"invalid_actions": 0.0})

    def _invalid(self, err: Exception) -> EpisodeStep:
        """The answer to a turn that is no valid action: ``error: ...`` (pydantic's errors as ``field: message``)."""
        details = getattr(err, "errors", None)
        error = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in details()) if details else err
        return EpisodeStep([{"role": self.reply_role, "content": f"error: {error}"}], metrics={"invalid_actions": 1.0})

    def _call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, Any, bool]:
        """``reset`` / ``step`` on the environment or client: (observation, reward, done); ``ActionRefused`` when a
        server refuses an action that does not fit its schema."""
        from openenv.core.client_types import StepResult

        try:
            result = getattr(self.env, method)(*args, **kwargs)
            if inspect.isawaitable(result):  # an async EnvClient: on the hub loop, where its connection lives
                result = run_sync(result)
        except RuntimeError as err:  # EnvClient: "Server error: ... (code: VALIDATION_ERROR)"
            if "VALIDATION_ERROR" in str(err):
                raise ActionRefused(str(err)) from err
            raise
        if isinstance(result, StepResult):
            return result.observation, result.reward, bool(result.done)
        return result, result.reward, bool(result.done)


def _close(env: Any) -> None:
    """Close an episode's environment or client (once; errors while closing are not the episode's)."""
    try:
        result = env.close()
        if inspect.isawaitable(result):
            run_sync(result, timeout=10)
    except Exception:  # noqa: BLE001 - closing a finished session must not fail the run
        pass
