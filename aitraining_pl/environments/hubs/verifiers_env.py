"""verifiers environments (PyPI ``verifiers`` >= 0.4, ``import verifiers.v1 as vf``) played as episodes.

A verifiers environment is a ``Taskset`` (its rows: ``Task`` objects whose ``TaskData`` holds the ``prompt`` and
``system_prompt``, with ``@vf.reward``, ``@vf.metric`` and ``@vf.stop`` methods) played by an ``Env``: ``Env.run(task,
agents)`` is an episode's control flow. A single-agent env runs ``agents.agent.run(task)`` (one segment: the model
answers the prompt); a multi-turn env opens ``agents.<seat>.interaction(task)`` and answers each ``turn()`` with the
next user message (a game engine, a scripted user, an OpenEnv client), then ``Env.finalize`` judges the episode.

``VerifiersEnvironment`` runs the env's own ``setup`` / ``run`` / ``finalize`` with the policy in the seat. Where
verifiers launches a harness program that calls a model through its interception server, the seat here hands the
conversation to this library's episode loop (``sample_episodes``) and gets back the text of the turn the policy
sampled: the tokens trained on are the sampled ones, never re-tokenised. What maps to what:

- first messages: the task's ``system_prompt`` and ``prompt`` (a prompt-less task: the first ``turn(message)``);
- ``interaction.turn(message)``: ``message`` is the environment's reply (user messages), the policy's next turn
  comes back as the ``Segment``; ``Env.run`` returning (or a bare ``agents.<seat>.run(task)``) ends the episode;
- rewards: the seat's trace is scored as verifiers scores it (the task's ``@vf.reward`` functions and judges that need
  no runtime, then ``Env.finalize``; ``trace.record_reward`` from ``run`` counts too); the episode's reward is
  ``trace.reward`` (the sum of score x weight), given on its last turn, earlier turns 0;
- metrics: ``trace.metrics`` and each reward's score as ``reward_<name>``, on the last turn;
- ``@vf.stop`` hooks taking the ``Trace`` run before each turn after the first (as verifiers checks them before each
  model call); one that fires ends the exchange (its next ``turn()`` comes back ``terminated``);
- limits: the seat's ``max_turns`` (else this adapter's). A turn refused by it stops the trace as ``max_turns``
  (scored) and the episode counts as truncated; an episode cut by ``max_total_tokens`` is not scored (reward 0).

Not played: tool servers (``Toolset``: MCP servers in a runtime), seats other than the policy's (verifiers plays them
with another model), ``Request`` / ``Response`` hooks (they act on the interception server's HTTP calls).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import queue
import weakref
from contextlib import asynccontextmanager
from typing import Any, get_type_hints

from aitraining_pl.environments.episode import AssistantTurn, EpisodeEnvironment, EpisodeLimits, EpisodeStep, Message
from aitraining_pl.environments.hubs.common import background_loop, require
from aitraining_pl.errors import ConfigError

_WHO = "VerifiersEnvironment"
_END = object()  # the hub side's last word: the episode is over (or failed)


def _load(vf, env: Any, env_args: dict | None):
    """``env`` as a verifiers ``Env`` or ``Taskset``: as given, from an import path, or from an environment id."""
    try:
        if isinstance(env, str) and ":" in env:
            from aitraining_pl.rewards import import_object

            env = import_object(env)
            env = env() if callable(env) and not isinstance(env, (vf.Env, vf.Taskset)) else env
        elif isinstance(env, str):  # an installed environment package, loaded as `vf-eval <id>` loads it
            args = dict(env_args or {})
            config = vf.resolve_env_config({**args, "taskset": {**dict(args.get("taskset") or {}), "id": env}})
            env = vf.load_environment(config)
    except (ImportError, ValueError, TypeError) as err:  # verifiers' own messages name the id and what it tried
        raise ConfigError(f"{_WHO}: env {env!r}", str(err).splitlines()[0]) from err
    if not isinstance(env, (vf.Env, vf.Taskset)):
        raise ConfigError(f"{_WHO}: env", f"a verifiers Env or Taskset (or its id / import path), not {env!r:.80}")
    return env


def as_messages(messages: Any) -> list[Message]:
    """verifiers messages (a string: one user message) as chat-template dicts."""
    from verifiers.v1.dialects import parse_message
    from verifiers.v1.types import content_text

    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    parsed = [parse_message(m) if isinstance(m, dict) else m for m in messages or []]
    return [{"role": m.role, "content": content_text(m.content)} for m in parsed]


class VerifiersEnvironment(EpisodeEnvironment):
    """A verifiers environment as an episode environment (see the module docstring for what maps to what).

    Args:
        env: a verifiers ``Env`` (e.g. ``vf.load_environment(config)``), a ``Taskset`` (played as verifiers'
            single-agent env plays it: one answer per task), an installed environment id (``"gsm8k"``) or an import
            path ``"pkg.module:object"`` of either (a factory is called).
        env_args: with an id, the rest of the environment's config (verifiers' ``[env]`` table, e.g.
            ``{"taskset": {...}}``).
        seat: the seat the policy plays (an ``AgentConfig`` field of the env's config); default: the only seat.
        max_turns: assistant turns per episode when the seat sets none.
        max_total_tokens: tokens after the prompt per episode.
        task_key: metadata key holding the task's index in the taskset (``rows()`` writes it); without it, the
            prompt selects the task whose prompt text it is.
    """

    def __init__(
        self,
        env: Any,
        env_args: dict | None = None,
        seat: str | None = None,
        max_turns: int = 4,
        max_total_tokens: int = 1 << 16,
        task_key: str = "task",
    ):
        self.vf = require("verifiers.v1", "verifiers", _WHO)
        self.env = _load(self.vf, env, env_args)
        taskset = self.env if isinstance(self.env, self.vf.Taskset) else self.env.taskset
        if not taskset.bounded:
            raise ConfigError(f"{_WHO}: env", "the taskset is infinite; bound it first (taskset.take(n))")
        if taskset.toolsets(taskset.config) or type(taskset).task_type().toolsets(taskset.config.task):
            raise ConfigError(f"{_WHO}: env", "its tool servers (vf.Toolset: MCP servers in a runtime) are not played")
        self.tasks = {task.data.idx: task for task in taskset}
        seats = self._seats()
        self.seat = seat or (next(iter(seats)) if len(seats) == 1 else None)
        if self.seat not in seats:
            raise ConfigError(f"{_WHO}: seat", f"{seat!r} is not one of the env's seats {sorted(seats)}")
        self.agent = seats[self.seat]
        turns = self.agent.max_turns or max_turns
        self.limits = EpisodeLimits(max_turns=turns, max_total_tokens=max_total_tokens)
        self.task_key = task_key

    def _seats(self) -> dict:
        if isinstance(self.env, self.vf.Taskset):
            return {"agent": self.vf.AgentConfig()}
        from verifiers.v1.configs.agent import agent_config_fields

        return agent_config_fields(self.env.config)

    def rows(self) -> list[dict]:
        """The taskset as prompt rows (``{"prompt": text, "task": index}``) for ``PromptDataModule``."""
        return [{"prompt": t.data.prompt_text, self.task_key: i} for i, t in self.tasks.items()]

    def spawn(self) -> VerifiersEnvironment:
        return copy.copy(self)  # the Env, its taskset and tasks are shared (verifiers keeps no per-episode state there)

    def reset(self, prompt: str, metadata: dict) -> list[Message]:
        self.channel = channel = queue.Queue()
        self.player = _Player(self, self._task(prompt, metadata))  # holds no reference to this object
        self.episode = asyncio.run_coroutine_threadsafe(self.player.play(), background_loop())
        self.episode.add_done_callback(lambda _: channel.put(_END))
        weakref.finalize(self, self.episode.cancel)  # an episode cut by a limit never hears from the loop again
        first = self._next()
        if first is None:
            raise ValueError(f"{_WHO}: Env.run ended before seat {self.seat!r} took a turn")
        return first

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        background_loop().call_soon_threadsafe(self.player.answer, turn.text)
        messages = self._next()
        if messages is not None:
            return EpisodeStep(messages=messages)
        trace = self.episode.result()
        metrics = {k: v for k, v in trace.metrics.items() if v is not None}
        metrics.update({f"reward_{k}": r.score for k, r in trace.rewards.items() if r is not None})
        if self.player.refused is not None:  # a limit refused the env's next message: truncated, not done
            return EpisodeStep(messages=self.player.refused, reward=trace.reward, metrics=metrics)
        return EpisodeStep(done=True, reward=trace.reward, metrics=metrics)

    def _next(self) -> list[Message] | None:
        """The messages before the policy's next turn, or None when the episode is over (its error raised here)."""
        item = self.channel.get()
        if item is _END:
            self.episode.result()  # raises what Env.run / scoring raised
            return None
        return item

    def _task(self, prompt: str, metadata: dict):
        if self.task_key in metadata:
            key = metadata[self.task_key]
            if key not in self.tasks:
                raise ValueError(f"{_WHO}: metadata {self.task_key!r} = {key!r} is not a task index of the taskset")
            return self.tasks[key]
        for task in self.tasks.values():
            if task.data.prompt_text == prompt:
                return task
        raise ValueError(
            f"{_WHO}: the prompt {prompt[:60]!r} is no task's prompt and its metadata has no {self.task_key!r}: "
            "use rows() as the prompts"
        )


class _Agents:
    """``Env.run``'s ``agents``: ``agents.<seat>`` is the policy's seat; any other seat refuses."""

    def __init__(self, player: _Player):
        self._player = player

    def __getattr__(self, name: str) -> _Player:
        if name.startswith("_"):
            raise AttributeError(name)
        if name != self._player.seat:
            raise ValueError(
                f"{_WHO}: Env.run uses seat {name!r}; only the policy's seat {self._player.seat!r} is played here "
                "(verifiers plays the others with another model)"
            )
        return self._player


class _Player:
    """The policy's seat in one episode, on the hub loop: the seat's ``run`` / ``interaction`` and the interaction's
    ``turn`` (each turn waits for ``step`` to hand over the policy's text)."""

    def __init__(self, owner: VerifiersEnvironment, task):
        self.vf, self.env, self.task, self.channel = owner.vf, owner.env, task, owner.channel
        self.seat, self.max_turns, self.trainable, self.turns = owner.seat, owner.limits.max_turns, True, 0
        self.trace = self.vf.Trace(
            task=self.vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=self.vf.AgentInfo(config=owner.agent, name=owner.seat),
        )
        self.opening: list[Message] = []
        self.reply: asyncio.Future | None = None
        self.refused: list[Message] | None = None
        self.stops: list = []

    async def play(self):
        env = self.env
        if isinstance(env, self.vf.Taskset):
            await self.run(self.task)
            return self.trace
        agents = _Agents(self)
        await env.setup(agents)
        if not self.trainable:
            raise ValueError(f"{_WHO}: Env.setup marks seat {self.seat!r} untrainable; name the policy's seat")
        await env.run(self.task, agents)
        episode = self.vf.Episode(
            env=self.vf.EnvInfo(id=env.config.env_id),
            task=self.trace.task,
            traces=[self.trace],
            ok=True,
        )
        await env.finalize(self.task, episode)
        return self.trace

    async def run(self, task, **_: Any):
        """``agents.<seat>.run(task)``: one segment on the task's prompt."""
        async with self.interaction(task) as exchange:
            await exchange.turn()
            self.trace.stop("agent_completed")
        return self.trace

    @asynccontextmanager
    async def interaction(self, task, **_: Any):
        """``agents.<seat>.interaction(task)``: the exchange on ``task`` (the env may hand the seat a copy, e.g. with
        its prompt hidden), scored as verifiers scores it when it closes."""
        self.task, data = task, task.data
        self.opening = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        self.opening += as_messages(data.prompt) if data.prompt is not None else []
        self.stops = [fn for fn in task.hooks("stop") if _on_trace(self.vf, fn)]
        self.trace.task = self.vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash)
        yield self
        self.trace.stop("user_closed")
        await task.score(self.trace)
        self.trace.ok = True

    async def turn(self, message: Any = None):
        """One turn of the policy after ``message`` (a ``Segment``; ``terminated`` when a limit or stop refused it)."""
        from verifiers.v1.dialects import parse_message

        vf, trace = self.vf, self.trace
        messages = (self.opening if self.turns == 0 else []) + (as_messages(message) if message else [])
        if self.turns and trace.stop_condition is None:
            for stop in self.stops:
                if await _call(vf, stop, trace, self.task):
                    trace.stop(stop.__name__)
        if self.turns >= self.max_turns:
            trace.stop("max_turns")
            self.refused = messages
        if trace.stop_condition is not None:
            return vf.Segment(messages=[], terminated=True)
        if not messages:
            raise ValueError(f"{_WHO}: turn() without a message on a task without a prompt: nothing to answer")
        for m in messages:
            self._node(parse_message(m), sampled=False)
        self.reply = asyncio.get_running_loop().create_future()
        self.channel.put(messages)
        text = await self.reply
        self.turns += 1
        self._node(vf.AssistantMessage(content=text), sampled=True)
        return vf.Segment(messages=[trace.nodes[-1].message])

    def answer(self, text: str) -> None:
        """The policy's turn (called on the hub loop by ``step``)."""
        self.reply.set_result(text)

    def _node(self, message, sampled: bool) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(self.vf.MessageNode(message=message, parent=parent, sampled=sampled))


def _on_trace(vf, fn) -> bool:
    """Whether a ``@vf.stop`` hook reads the trace (not a ``Request`` / ``Response`` of the interception server)."""
    hints = get_type_hints(fn)
    return not any(hints.get(p) in (vf.Request, vf.Response) for p in inspect.signature(fn).parameters)


async def _call(vf, fn, trace, task) -> bool:
    from verifiers.v1.utils.decorators import invoke

    result = invoke(fn, {vf.Trace: trace, "trace": trace, "task": task.data})
    return bool(await result if inspect.isawaitable(result) else result)
