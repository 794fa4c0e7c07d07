"""The episode protocol: an environment that answers the model between its turns.

An episode starts from a prompt: ``reset(prompt, metadata)`` returns the first messages (or ``None`` to keep
the data module's prompt tokens as they are). Then, turn by turn, the model writes an assistant turn and
``step(turn)`` answers with an ``EpisodeStep``: the environment's reply messages (``user`` or ``tool``
messages, rendered by the chat template and appended as tokens), ``done`` when the episode is over, a
``reward`` for this turn (a final reward is the reward of the last turn; per-turn rewards sum to the episode
return) and metrics. One environment object plays one episode: the rollout makes a fresh one per episode with
``spawn()`` (a deep copy of the configured object, before ``reset``).

::

    class Guess(EpisodeEnvironment):
        def reset(self, prompt, metadata):
            self.secret = metadata["secret"]
            return [{"role": "user", "content": prompt}]

        def step(self, turn):
            guess = int(turn.text.strip() or -1)
            if guess == self.secret:
                return EpisodeStep(done=True, reward=1.0, metrics={"success": 1.0})
            return EpisodeStep(messages=[{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

A reply may show a vision-language policy images: content parts with ``{"type": "image"}`` placeholders and the
images in ``EpisodeStep.images`` (or parts that carry their own, ``environments.chat``)::

    EpisodeStep(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
                images=[square])

Limits (``EpisodeLimits``) bound each episode: turns, tokens per turn (``GenerationConfig.max_new_tokens``),
total response tokens (model and environment tokens after the prompt); the tool limits live in
``environments.tools``. An episode stopped by a limit is *truncated* (``Rollout.ended`` False).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aitraining_pl.rewards import score_responses

Message = dict[str, Any]


@dataclass
class EpisodeLimits:
    """Limits of one episode.

    Args:
        max_turns: assistant turns at most.
        max_total_tokens: tokens after the prompt at most (model and environment tokens together); a turn
            starts only while the episode has room for the environment's reply and a whole turn.
        max_reply_chars: characters of message content one reply (or ``reset``) may hand over; the rest is cut,
            with a note, before it is rendered and tokenised (``environments.episode_guard``).
    """

    max_turns: int = 4
    max_total_tokens: int = 1024
    max_reply_chars: int = 100_000

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1 or self.max_reply_chars < 1:
            raise ValueError(f"episode limits must be >= 1, got {self}")


@dataclass
class AssistantTurn:
    """One turn of the model, as sampled."""

    text: str  #: decoded, special tokens removed
    raw_text: str  #: decoded with special tokens (tool-call markers such as ``[TOOL_CALLS]`` are special)
    token_ids: list[int]  #: the sampled tokens, end token included
    ended: bool  #: ended by an end token or stop (False: cut at the tokens-per-turn limit)
    index: int  #: 0 for the first turn


@dataclass
class EpisodeStep:
    """The environment's answer to a turn."""

    messages: list[Message] = field(default_factory=list)  #: reply messages (``user`` / ``tool``), if not done
    done: bool = False  #: the episode is over (no reply is rendered)
    reward: float = 0.0  #: this turn's reward
    metrics: dict[str, float] = field(default_factory=dict)  #: summed over the episode's turns
    #: the images of the reply's ``{"type": "image"}`` content parts, in order (PIL images, paths, bytes or data
    #: URLs), for a vision-language policy (``environments.chat``)
    images: list[Any] = field(default_factory=list)


class EpisodeEnvironment:
    """Base class of environments that talk back (see the module docstring). Subclasses implement ``reset``
    and ``step``; ``tools`` lists the JSON schemas the chat template shows the model (empty: no tools)."""

    limits: EpisodeLimits = EpisodeLimits()

    @property
    def tools(self) -> list[dict]:
        """JSON schemas of the tools offered to the model (``transformers.utils.get_json_schema``)."""
        return []

    def for_template(self, chat_template: str | None) -> None:
        """Called with the chat template before episodes start (a tool environment resolves its format)."""

    def spawn(self) -> EpisodeEnvironment:
        """A fresh environment for one episode (a deep copy of this one)."""
        return copy.deepcopy(self)

    def reset(self, prompt: str, metadata: dict) -> list[Message] | None:
        """Start an episode; the first messages (rendered with the tools), or None for the data module's prompt."""
        raise NotImplementedError

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        """Answer one assistant turn."""
        raise NotImplementedError


def is_episode_environment(obj: Any) -> bool:
    """Whether ``obj`` plays multi-turn episodes (an ``EpisodeEnvironment``)."""
    return isinstance(obj, EpisodeEnvironment)


class OneTurnEpisode(EpisodeEnvironment):
    """A reward source (any ``(prompts, responses, metadata) -> scores`` callable, e.g. the seed's
    ``TextGenerationEnv``, ``MathProblemEnv`` or ``CodeGenerationEnv``) as a one-turn episode: the data
    module's prompt, one response, scored when it ends. The same tokens and scores as the single-response path.

    Args:
        reward: the reward source.
    """

    limits = EpisodeLimits(max_turns=1, max_total_tokens=1 << 30)

    def __init__(self, reward: Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]):
        self.reward = reward

    def spawn(self) -> OneTurnEpisode:
        episode = copy.copy(self)  # the reward source (maybe a model) is shared, never copied
        return episode

    def reset(self, prompt: str, metadata: dict) -> None:
        self.prompt, self.metadata = prompt, metadata
        return None

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        # checked as a reward source's scores; no timeout of its own: the step it runs in has the run's
        (score,), _ = score_responses(self.reward, [self.prompt], [turn.text], [self.metadata], timeout=None)
        return EpisodeStep(done=True, reward=score)
