"""``AgentEnvironment``: train an agent written against the OpenAI API (or any framework that speaks it).

The user gives ``agent(client, prompt, metadata) -> reward``, sync or async. ``client`` is an ``openai.OpenAI``
(``openai.AsyncOpenAI`` for an async agent) bound to the episode: its ``base_url`` and ``api_key`` (the episode's
key) are what another framework needs (``ChatOpenAI(base_url=str(client.base_url), api_key=client.api_key)``:
LangChain refuses the ``httpx.URL`` that ``base_url`` is). The agent makes whatever calls it likes (tools,
sub-calls, history edits); the endpoint (``agents.endpoint``) records each token-in / token-out, and
``play_episodes`` turns them into the rollout the online modules train on.

Rows (``max_sequences`` per episode, so every iteration has the same row count on every rank): an episode's
records become sequences (``recording.split_sequences``): calls that extend the conversation token for token are
one sequence, the tokens between the calls (tool results, user messages) masked out (``response_mask`` 0,
``episodes.response_attention`` 1); a call after a rewritten history starts a new sequence. An episode with more
sequences than ``max_sequences`` keeps its last ones (``episode/dropped_sequences`` counts the others); unused rows
are all masked (``response_mask`` 0, the data module's prompt only). Rows of prompt ``i`` are contiguous,
``group`` is the prompt index of each row, ``episodes.episode`` the episode index.

**Advantages.** Every row of an episode carries the episode's reward (``returns``; ``token_rewards`` on the last
sampled token of each sequence). Group statistics (GRPO's mean and std, RLOO's leave-one-out baseline) are taken
over *episodes* (one value per ``episodes.episode``: ``losses.advantages.compute_advantages``), not over rows, and
every sequence of an episode gets its episode's advantage (all of it, not a share: each sequence is a full decision
path that earned the reward, as in AReaL's and verl's multi-sequence agent rollouts); all-masked rows get none.
With ``max_sequences: 1`` and agents that never rewrite their history, rows are episodes.

**Columns.** The prompt part of a row is the data module's prompt (left padded). Where a sequence starts with
those tokens, the rest follows in the response part; where the agent rendered its own first prompt (a system
message, tools), the data module's prompt is masked out of that row (``prompt_mask`` 0) and the whole sequence,
its first prompt included, is in the response part (attention 1, ``response_mask`` 0 but on sampled tokens): the
model is shown exactly what the endpoint fed it. ``sampling_logprobs`` are those recorded at sampling.

Each episode runs in its own thread (sync agents, at most ``max_concurrency`` at once) or on one asyncio loop
(async agents) in a thread of its own, under the environments' guards: at most ``timeout`` seconds (the modules'
``reward_timeout``). An async agent that blocks its loop (``time.sleep``) or swallows its cancellation cannot hold
the run: the loop's thread is waited for ``timeout`` seconds (and a little more), then abandoned, its unfinished
episodes timed out. An exception, ``sys.exit`` / ``os._exit`` in the agent's own thread, a timeout, or a reward that
is not a finite number is an *agent error*: ``on_agent_error`` says what it does (``stop``: the run stops with one
``RewardError`` naming the agent; ``zero_reward``: the episode scores 0 and trains on what it sampled; ``drop``:
the episode gives no rows and no group statistic); ``episode/agent_errors`` counts them. ``os._exit`` from a
thread the agent itself starts cannot be told apart by episode: it ends that thread only (``guarded_call.
exits_watched``) and then stops the run with one ``RewardError`` naming the agent, the thread and the code, whatever
``on_agent_error`` says (agents run in the trainer's process, which they share with the endpoint and the policy; a
crash of the interpreter still ends it). A finished (or timed-out) episode's key is closed at once.

**Misattribution.** Calls are attributed by key, so agents that share one client (a process-global default, e.g.
the OpenAI Agents SDK's ``set_default_openai_client``) land in one episode. ``episode/no_calls`` counts episodes
that returned without a call through their key, ``episode/overlapping_calls`` calls that reached a key while
another conversation's call on it was pending; either warns once.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from aitraining_pl.agents.endpoint import AgentEndpoint, require_agents_extra
from aitraining_pl.agents.recording import split_sequences
from aitraining_pl.agents.rows import episode_rows
from aitraining_pl.environments.chat import check_assistant_turns
from aitraining_pl.environments.episode import EpisodeEnvironment, EpisodeLimits
from aitraining_pl.errors import RewardError
from aitraining_pl.guarded_call import CallInterrupted, CallTimeout, exits_watched, guarded_call
from aitraining_pl.rewards import DEFAULT_REWARD_TIMEOUT, describe_failure, import_object
from aitraining_pl.rollout import Rollout, RolloutEngine

#: what an agent error does (``AgentEnvironment``'s ``on_agent_error``)
AGENT_ERROR_POLICIES = ("stop", "zero_reward", "drop")


class AgentEnvironment(EpisodeEnvironment):
    """Episodes played by a user's agent through the OpenAI-compatible endpoint (see the module docstring).

    Args:
        agent: ``agent(client, prompt, metadata) -> reward`` (sync or async), or its import path
            ``"pkg.module:function"``.
        max_sequences: training rows per episode (sequences beyond are dropped, the first ones first).
        max_concurrency: sync agents running at once (None: every episode of the batch).
        request_sampling: honour a request's ``temperature`` / ``top_p`` (default: the run's settings sample
            every call, so the trainer's log-probs are of the distribution sampled from).
        chat_template: a chat template for the endpoint instead of the tokenizer's (e.g. a tool-calling one), or
            the import path ``"pkg.module:NAME"`` of one.
        batch_window: seconds the endpoint's sampler waits for other calls to sample together (at most: it samples
            as soon as every open episode has a call pending).
        client_timeout: seconds the episode's client waits for one answer.
        on_agent_error: what an agent error (see the module docstring) does: ``stop`` (default), ``zero_reward``
            or ``drop``.
    """

    limits = EpisodeLimits(max_turns=1 << 20, max_total_tokens=1 << 30)

    def __init__(
        self,
        agent: Callable | str,
        max_sequences: int = 2,
        max_concurrency: int | None = None,
        request_sampling: bool = False,
        chat_template: str | None = None,
        batch_window: float = 0.05,
        client_timeout: float = 600.0,
        on_agent_error: str = "stop",
    ):
        require_agents_extra()
        if on_agent_error not in AGENT_ERROR_POLICIES:
            known = ", ".join(AGENT_ERROR_POLICIES)
            raise ValueError(f"AgentEnvironment: on_agent_error must be one of {known}, got {on_agent_error!r}")
        self.on_agent_error = on_agent_error
        self._warned: set[str] = set()
        if max_sequences < 1:
            raise ValueError(f"AgentEnvironment: max_sequences must be >= 1, got {max_sequences}")
        self.agent = import_object(agent) if isinstance(agent, str) else agent
        if not callable(self.agent):
            raise TypeError(f"AgentEnvironment: agent must be callable, got {type(self.agent).__name__}")
        self.max_sequences, self.max_concurrency = int(max_sequences), max_concurrency
        if chat_template and "{" not in chat_template and ":" in chat_template:  # an import path
            chat_template = import_object(chat_template)
        if chat_template:
            try:
                check_assistant_turns(chat_template)
            except ValueError as err:
                raise ValueError(f"AgentEnvironment: chat_template: {err}") from None
        self.options = {"request_sampling": request_sampling, "chat_template": chat_template}
        self.batch_window, self.client_timeout = batch_window, client_timeout
        self._endpoint: list[AgentEndpoint | None] = [None]  # one for the run, started on the first batch
        self._http: list[Any] = [None]  # the sync episodes' connection pool

    @property
    def name(self) -> str:
        """The agent's name, as errors show it."""
        return getattr(self.agent, "__qualname__", type(self.agent).__name__)

    def __getstate__(self) -> dict:  # a copy (spawn, pickling) never takes the running server
        return {**self.__dict__, "_endpoint": [None], "_http": [None]}

    def spawn(self) -> AgentEnvironment:
        """The environment itself: ``play_episodes`` keeps each episode apart by its key."""
        return self

    def reset(self, prompt: str, metadata: dict):
        raise NotImplementedError("AgentEnvironment plays whole episodes through play_episodes")

    def endpoint(self, engine: RolloutEngine, model: torch.nn.Module, version: Any = None) -> AgentEndpoint:
        """The run's endpoint, serving ``model`` through ``engine`` (started on first use)."""
        if self._endpoint[0] is None:
            self._endpoint[0] = AgentEndpoint(engine, model, batch_window=self.batch_window, **self.options).start()
        self._endpoint[0].bind(engine, model, version)
        return self._endpoint[0]

    def close(self) -> None:
        """Stop the endpoint and close the connection pool."""
        if self._http[0] is not None:
            self._http[0].close()
            self._http[0] = None
        if self._endpoint[0] is not None:
            self._endpoint[0].stop()
            self._endpoint[0] = None

    # ------------------------------------------------------------------ episodes
    def play_episodes(
        self,
        engine: RolloutEngine,
        model: torch.nn.Module,
        prompts: Sequence[str],
        metadata: Sequence[dict],
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        num_samples: int = 1,
        *,
        timeout: float | None = DEFAULT_REWARD_TIMEOUT,
        version: Any = None,
        vision: Any = None,
    ) -> Rollout:
        """Play ``num_samples`` episodes per prompt through the endpoint and return their ``Rollout`` (rows as in
        the module docstring); ``version`` is recorded as the weights version of every call (default: the
        backend's). An agent shows a VL policy images in its calls (``image_url`` parts); the data module's rows
        (``vision``, the prompts' images) must have none: the agent gets the prompt's text only."""
        if vision is not None and any(vision.prompts):
            raise ValueError(
                f"AgentEnvironment ({self._where}): the data module's prompts have images, which an agent never sees "
                "(it gets the prompt's text): send images in the agent's calls as image_url parts (data URLs)"
            )
        endpoint = self.endpoint(engine, model, version)
        groups = [g for g in range(len(prompts)) for _ in range(num_samples)]
        asynchronous = inspect.iscoroutinefunction(self.agent)
        # all at once: every episode counts as running from the start (the sampler waits for each one's call);
        # fewer workers than episodes: an episode counts once its worker starts it
        at_once = asynchronous or not self.max_concurrency or self.max_concurrency >= len(groups)
        keys = [endpoint.open_episode(running=at_once) for _ in groups]
        jobs = [(key, prompts[g], dict(metadata[g] if metadata is not None else {})) for key, g in zip(keys, groups)]
        try:
            with exits_watched() as exits:  # os._exit from a thread an agent started: caught, then the run stops
                if asynchronous:
                    rewards = self._run_async(endpoint, jobs, timeout)
                else:
                    if self._http[0] is None:
                        import openai

                        self._http[0] = openai.DefaultHttpxClient(timeout=self.client_timeout)
                    rewards = self._run_threads(endpoint, jobs, timeout)
            records = [endpoint.finish_episode(key) for key in keys]
            overlapping = [endpoint.overlapping(key) for key in keys]
        finally:
            for key in keys:
                endpoint.finish_episode(key)
            endpoint.forget(keys)
        if exits:
            thread, code = exits[0]
            why = f"a thread it started ({thread!r}) called os._exit({code}), which would have ended the run silently"
            raise RewardError(self._where, f"{why}: the run stops (an agent returns or raises, never exits)")
        rewards, failed = self._outcomes(rewards)
        records = [[] if bad and self.on_agent_error == "drop" else r for r, bad in zip(records, failed)]
        extra = [
            {"agent_errors": float(bad), "no_calls": float(not r and not bad), "overlapping_calls": float(o)}
            for r, bad, o in zip(records, failed, overlapping)
        ]
        self._check_attribution(extra, records, endpoint.context_length)
        pad = engine.pad_token_id(model, engine.end_token_ids(model))
        return episode_rows(
            records, rewards, groups, prompt_ids, prompt_mask, self.max_sequences, pad, engine.tokenizer, extra
        )

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"AgentEnvironment ({self._where}): {message}", stacklevel=3)

    def _check_attribution(self, extra: list[dict], records: list, context: int | None) -> None:
        """Warn once about misattributed calls, dropped sequences and rows past the context."""
        silent = sum(e["no_calls"] for e in extra)
        overlaps = sum(e["overlapping_calls"] for e in extra)
        if silent or overlaps:
            self._warn_once(
                "attribution",
                f"{silent:g} of {len(extra)} episodes made no call with their own key and {overlaps:g} calls reached "
                "a key while another conversation's call was pending: the agents probably share one client (e.g. "
                "the OpenAI Agents SDK's process-global set_default_openai_client), so calls are trained on the "
                "wrong episode; build each episode's model from its `client` (OpenAIChatCompletionsModel(model=..., "
                "openai_client=client), docs/agents.md) (counted as episode/no_calls, episode/overlapping_calls)",
            )
        counts = [len(split_sequences(r)) for r in records]
        if max(counts, default=0) > self.max_sequences:
            self._warn_once(
                "dropped",
                f"an episode gave {max(counts)} sequences and max_sequences is {self.max_sequences}: the first ones "
                "are not trained (episode/dropped_sequences); agents that rewrite their history (smolagents) start a "
                "new sequence per call (docs/agents.md says what max_sequences to use)",
            )
        longest = max((len(r.prompt_ids) + len(r.completion_ids) for rs in records for r in rs), default=0)
        if context is not None and longest > context:
            self._warn_once("context", f"a row of {longest} tokens is longer than the model's {context} positions")

    def _outcomes(self, results: list) -> tuple[list[float], list[bool]]:
        """Each episode's reward and whether it was an agent error (``on_agent_error``: ``stop`` raises it)."""
        rewards, failed = [], []
        for i, result in enumerate(results):
            try:
                rewards.append(self._reward(result, i))
                failed.append(False)
            except RewardError as err:
                if self.on_agent_error == "stop":
                    raise
                self._warn_once(
                    "error", f"{err} (on_agent_error: {self.on_agent_error}; counted as episode/agent_errors)"
                )
                rewards.append(0.0)
                failed.append(True)
        return rewards, failed

    def _client(self, endpoint: AgentEndpoint, key: str, http=None):
        """The episode's client: an ``openai.OpenAI`` (``AsyncOpenAI`` given an async ``http`` client) with the
        episode's key, on a connection pool shared by the episodes (a client of its own costs ~25 ms of CPU)."""
        import openai

        kind = openai.OpenAI if http is None else openai.AsyncOpenAI
        http = self._http[0] if http is None else http
        return kind(
            base_url=endpoint.base_url, api_key=key, max_retries=0, timeout=self.client_timeout, http_client=http
        )

    def _episode(self, endpoint: AgentEndpoint, key: str, prompt: str, metadata: dict) -> Any:
        endpoint.start_episode(key)
        try:
            return self.agent(self._client(endpoint, key), prompt, metadata)
        finally:
            endpoint.finish_episode(key)

    def _run_threads(self, endpoint: AgentEndpoint, jobs: list, timeout: float | None) -> list[float]:
        workers = max(1, min(len(jobs), self.max_concurrency or len(jobs)))

        def run(job):
            try:
                return guarded_call(self._episode, (endpoint, *job), timeout)
            except (Exception, SystemExit) as err:
                return err
            finally:
                endpoint.finish_episode(job[0])

        with ThreadPoolExecutor(workers, thread_name_prefix="agent-episode") as pool:
            return list(pool.map(run, jobs))

    def _run_async(self, endpoint: AgentEndpoint, jobs: list, timeout: float | None) -> list:
        """The async episodes' outcomes (rewards or exceptions), on one loop in a thread that is abandoned
        ``timeout`` seconds (and a little more) after it starts (see the module docstring)."""
        outcomes: list[Any] = [CallTimeout() for _ in jobs]

        async def one(i, http, key, prompt, metadata):
            endpoint.start_episode(key)
            try:
                agent = self.agent(self._client(endpoint, key, http), prompt, metadata)
                outcomes[i] = await asyncio.wait_for(agent, timeout)
            except asyncio.TimeoutError:
                outcomes[i] = CallTimeout()
            except (Exception, SystemExit) as err:
                outcomes[i] = err
            finally:
                endpoint.finish_episode(key)

        async def every():
            import openai

            async with openai.DefaultAsyncHttpxClient(timeout=self.client_timeout) as http:
                await asyncio.gather(*(one(i, http, *job) for i, job in enumerate(jobs)))

        try:
            guarded_call(asyncio.run, (every(),), None if timeout is None else timeout * 1.1 + 2.0)
        except CallTimeout:  # the loop is blocked (or a task ignores its cancellation): abandoned with its thread
            for key, *_ in jobs:
                endpoint.finish_episode(key)
        except (Exception, SystemExit) as err:
            return [err] * len(jobs)
        return outcomes

    @property
    def _where(self) -> str:
        return f"agent {self.name!r}"

    def _reward(self, value: Any, episode: int) -> float:
        """An episode's outcome checked: a finite float, else one ``RewardError`` naming the agent."""
        if isinstance(value, (RewardError, CallInterrupted)):
            raise value
        if isinstance(value, CallTimeout):
            raise RewardError(self._where, f"episode {episode} did not return within the timeout (reward_timeout)")
        if isinstance(value, BaseException):
            raise RewardError(self._where, f"episode {episode} {describe_failure(value)}") from value
        number = None
        if not isinstance(value, (str, bytes, bool)) and value is not None:
            try:
                number = float(value)
            except (TypeError, ValueError):
                pass
        if number is None:
            raise RewardError(self._where, f"episode {episode} returned {value!r:.60}, not a float reward")
        if not math.isfinite(number):
            raise RewardError(self._where, f"episode {episode} returned a non-finite reward ({number})")
        return number
