"""Two responses per prompt, then a preference: collecting comparisons for RLHF and DPO."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aitraining_pl.environments.base import Observation, StepResult
from aitraining_pl.environments.text import TextGenerationEnv, as_token_list


class ScoresTexts(Protocol):
    """Anything with the reward model's ``predict_rewards`` (e.g. ``aitraining_pl.models.RewardModel``)."""

    def predict_rewards(self, texts: Sequence[str], tokenizer: Any, batch_size: int = ...) -> Sequence[float]: ...


#: ``fn(prompt, response_a, response_b) -> P(a preferred)`` in [0, 1] (0/1 for a hard label), or ``None``
#: to defer to the preference model.
FeedbackFn = Callable[[str, str, str], float | None]


class PreferenceComparisonEnv(TextGenerationEnv):
    """Each episode is one prompt and two responses; the second step returns the preference between them.

    ``step(response_tokens)`` takes a whole response (cut at EOS, a stop sequence or ``max_length`` like a
    ``TextGenerationEnv`` chunk). The first step returns reward 0 and the prompt again as the next
    observation; the second computes ``preference = P(response 1 preferred over response 2)``:
    from ``human_feedback_fn`` when given (it may return ``None`` to defer), else from
    ``preference_model``, whose rewards ``r1, r2`` for prompt+response give the Bradley-Terry probability
    ``sigmoid(r1 - r2)`` (Bradley & Terry 1952). The second step's ``reward`` is that preference;
    ``info`` holds both responses, ``chosen`` / ``rejected`` (ties go to response 1), and the rewards.
    Every comparison is kept; ``preference_pairs()`` returns them as DPO data.

    As a reward source it scores single responses with ``preference_model`` (a callback alone cannot).

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompts: the prompts of the episodes.
        preference_model: an object with ``predict_rewards(texts, tokenizer, batch_size)``, e.g. a
            ``RewardModel``.
        human_feedback_fn: ``fn(prompt, response_1, response_2) -> P(response_1 preferred)`` or ``None``.
        max_length: maximum tokens of prompt plus one response.
        **kwargs: the other ``TextGenerationEnv`` arguments.
    """

    def __init__(
        self,
        tokenizer,
        prompts: Sequence[str],
        preference_model: ScoresTexts | None = None,
        human_feedback_fn: FeedbackFn | None = None,
        max_length: int = 512,
        **kwargs: Any,
    ):
        if preference_model is None and human_feedback_fn is None:
            raise ValueError("PreferenceComparisonEnv needs a preference_model, a human_feedback_fn, or both")
        if preference_model is not None and not callable(getattr(preference_model, "predict_rewards", None)):
            raise TypeError("preference_model must have predict_rewards(texts, tokenizer, batch_size)")
        super().__init__(tokenizer, prompts, max_length=max_length, **kwargs)
        self.preference_model = preference_model
        self.human_feedback_fn = human_feedback_fn
        self.comparisons: list[dict[str, Any]] = []
        self._responses: list[str] = []

    def _model_rewards(self, prompt: str, responses: Sequence[str]) -> list[float]:
        if self.preference_model is None:
            raise ValueError("scoring single responses needs a preference_model (human_feedback_fn compares pairs)")
        texts = [prompt + r for r in responses]
        return [float(r) for r in self.preference_model.predict_rewards(texts, self.tokenizer, batch_size=len(texts))]

    def score(self, prompt: str, generated: str, metadata: dict | None = None) -> tuple[float, dict[str, float]]:
        generated, _ = self.truncate_at_stop(generated)
        return self._model_rewards(prompt, [generated])[0], {}

    def preference(self, prompt: str, response_1: str, response_2: str) -> tuple[float, dict[str, float]]:
        """``P(response_1 preferred)`` and how it was obtained (``source``, model rewards if used)."""
        if self.human_feedback_fn is not None:
            value = self.human_feedback_fn(prompt, response_1, response_2)
            if value is not None:
                value = float(value)
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"human_feedback_fn must return a probability in [0, 1], got {value}")
                return value, {"source": "human"}
        if self.preference_model is None:
            raise ValueError("human_feedback_fn returned None and there is no preference_model to defer to")
        r1, r2 = self._model_rewards(prompt, [response_1, response_2])
        return 1.0 / (1.0 + math.exp(-(r1 - r2))), {"source": "model", "reward_1": r1, "reward_2": r2}

    def reset(self, index: int | None = None) -> Observation:
        self._responses = []
        return super().reset(index)

    def step(self, action: Any, logprob=None) -> StepResult:
        """Give one whole response; the second one ends the episode with the preference."""
        ep = self._require_running()
        tokens = as_token_list(action)
        reason = self._append(tokens) or "end_of_response"
        self._responses.append(ep["text"])
        info: dict[str, Any] = {
            "prompt": ep["prompt"],
            "response_index": len(self._responses) - 1,
            "stop_reason": reason,
        }
        if len(self._responses) == 1:
            ep["tokens"], ep["text"] = [], ""  # the second response starts from the prompt again
            ep["rewards"].append(0.0)
            return StepResult(0.0, False, self._observation(), {**info, "response": self._responses[0]}, {})
        first, second = self._responses
        value, how = self.preference(ep["prompt"], first, second)
        chosen, rejected = (first, second) if value >= 0.5 else (second, first)
        comparison = {"prompt": ep["prompt"], "chosen": chosen, "rejected": rejected, "preference": value}
        self.comparisons.append(comparison)
        info.update(response_1=first, response_2=second, chosen=chosen, rejected=rejected, **how)
        metrics = {"preference": value, **{k: v for k, v in how.items() if k.startswith("reward_")}}
        ep["done"], ep["metrics"] = True, metrics
        ep["rewards"].append(value)
        return StepResult(value, True, None, info, metrics)

    def rollout(self, model, index=None, generator=None):
        """Not available: here a step is a whole response. Sample two responses (e.g. with
        ``ForwardBackwardPipeline.sample``) and pass each to ``step``."""
        raise NotImplementedError("PreferenceComparisonEnv.step takes whole responses; sample them, then step twice")

    def preference_pairs(self) -> dict[str, list[str]]:
        """The comparisons so far as ``{"prompts", "chosen", "rejected"}`` lists (``PreferenceDataset`` input)."""
        return {
            "prompts": [c["prompt"] for c in self.comparisons],
            "chosen": [c["chosen"] for c in self.comparisons],
            "rejected": [c["rejected"] for c in self.comparisons],
        }

    def render(self) -> str:
        lines = [super().render().split("\n")[0]]
        lines += [f"Response {i + 1}: {r}" for i, r in enumerate(self._responses)]
        if self.comparisons and self._episode is not None and self._episode["done"]:
            lines.append(f"[done, P(response 1 preferred)={self.comparisons[-1]['preference']:.4f}]")
        return "\n".join(lines)
