"""The environment data classes, the abstract environment and the reward-source side of every environment.

An environment here is a text episode: ``reset()`` picks a prompt, ``step(action)`` appends generated
tokens, and the reward arrives when the episode ends. The same scoring is exposed as a *reward source*
(``env(prompts, responses, metadata) -> list[float]`` plus ``last_components``), the protocol that
``PPOModule`` uses, so any environment can score PPO rollouts without stepping token by token.
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: A reward function of the seed: ``fn(prompt, generated, full_text) -> float``. It may also accept a
#: ``metadata`` keyword (the prompt's metadata dict, e.g. a math problem's answer); it gets it if it does.
RewardFn = Callable[..., float]


@dataclass
class Observation:
    """What the agent sees: the token ids so far (prompt plus generated, shape (1, T)) and their mask."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """Result of ``env.step``: ``next_observation`` is ``None`` once the episode is over."""

    reward: float
    done: bool
    next_observation: Observation | None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    """A whole episode: one observation, action and reward per step (``logprobs`` when the caller gave them)."""

    observations: list[Observation]
    actions: list[torch.Tensor]
    rewards: list[float]
    logprobs: list[torch.Tensor]
    done: bool
    total_reward: float
    metrics: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def _accepts_metadata(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "metadata" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def call_reward_fn(fn: RewardFn, prompt: str, generated: str, full_text: str, metadata: dict | None) -> float:
    """Call a seed-style reward function, passing ``metadata=`` only if it takes it; the result as a float."""
    try:
        accepts = _accepts_metadata(fn)
    except TypeError:  # unhashable callable
        accepts = False
    value = fn(prompt, generated, full_text, metadata=metadata or {}) if accepts else fn(prompt, generated, full_text)
    return float(value)


class RLEnvironment(abc.ABC):
    """Abstract text environment: ``reset``, ``step``, ``render``, and scoring as a reward source.

    Subclasses implement ``score(prompt, generated, metadata) -> (reward, components)``; the reward-source
    call and the end-of-episode reward both use it, so an episode and a PPO rollout of the same text get the
    same reward.
    """

    #: per-component scores of the last reward-source call (name -> one score per response).
    last_components: dict[str, list[float]]

    @abc.abstractmethod
    def reset(self) -> Observation:
        """Start a new episode and return its first observation."""

    @abc.abstractmethod
    def step(self, action: Any) -> StepResult:
        """Apply ``action`` and return the result."""

    @abc.abstractmethod
    def render(self) -> str:
        """The current episode as text."""

    @abc.abstractmethod
    def score(self, prompt: str, generated: str, metadata: dict | None = None) -> tuple[float, dict[str, float]]:
        """Reward of ``generated`` as the answer to ``prompt``: ``(total, {component: score})``."""

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> list[float]:
        """The reward-source protocol: one reward per (prompt, response); components in ``last_components``."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
        metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
        if len(metadata) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(metadata)} metadata entries")
        totals: list[float] = []
        components: dict[str, list[float]] = {}
        for prompt, response, meta in zip(prompts, responses, metadata):
            total, parts = self.score(prompt, response, {**self.metadata_for(prompt), **(meta or {})})
            totals.append(total)
            for name, value in parts.items():
                components.setdefault(name, []).append(value)
        self.last_components = components
        return totals

    def as_episode(self):
        """This environment as a one-turn episode (``environments.episode.OneTurnEpisode``): the same tokens and
        scores as the single-response path."""
        from aitraining_pl.environments.episode import OneTurnEpisode

        return OneTurnEpisode(self)

    def metadata_for(self, prompt: str) -> dict:
        """Metadata the environment itself knows for ``prompt`` (merged under the caller's); {} by default."""
        return {}
