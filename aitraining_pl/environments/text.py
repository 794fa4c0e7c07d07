"""Token-by-token text generation episodes and their multi-objective form."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aitraining_pl.environments.base import (
    Observation,
    RewardFn,
    RLEnvironment,
    StepResult,
    Trajectory,
    call_reward_fn,
)
from aitraining_pl.rollout import GenerationConfig, RolloutEngine, end_token_ids

#: the word count at which the default reward saturates.
DEFAULT_TARGET_WORDS = 50


def word_count_reward(prompt: str, generated: str, full_text: str) -> float:
    """The default reward of ``TextGenerationEnv``: ``min(words(generated) / 50, 1.0)``.

    A placeholder that favours non-empty answers of up to 50 whitespace-separated words; pass your own
    ``reward_fn`` for anything real.
    """
    return min(len(generated.split()) / DEFAULT_TARGET_WORDS, 1.0)


def as_token_list(action: Any) -> list[int]:
    """One token (int or 0-d tensor) or a chunk (list, 1-D or (1, n) tensor) as a list of ints."""
    if isinstance(action, torch.Tensor):
        return [int(t) for t in action.reshape(-1).tolist()]
    if isinstance(action, int):
        return [action]
    return [int(t) for t in action]


class TextGenerationEnv(RLEnvironment):
    """Generate a response to a prompt; the reward arrives when the episode ends.

    ``step`` takes one token or a chunk of tokens. The episode ends at the first end token (the tokenizer's EOS;
    in ``rollout`` also the model's ``generation_config.eos_token_id``; tokens after it
    in a chunk are dropped), when a stop sequence appears in the *generated* text (the prompt is never
    searched), or when prompt plus response reach ``max_length`` tokens (a chunk is cut to fit). The text
    that is scored is the decoded response without special tokens, cut before the first stop sequence.
    Prompts are used in order, cycling, one per ``reset()`` (or pick one with ``reset(index)``).

    Args:
        tokenizer: a Hugging Face tokenizer, or a name for ``load_tokenizer`` (``"byte"``, folder, hub id).
        prompts: the prompts of the episodes.
        max_length: maximum tokens of prompt plus response (a longer prompt keeps its last tokens).
        reward_fn: ``fn(prompt, generated, full_text) -> float`` (it also gets ``metadata=`` if it takes
            it); default ``word_count_reward``: ``min(words / 50, 1)``.
        stop_sequences: strings that end the episode when they appear in the generated text.
        temperature: sampling temperature used by ``sample_action``.
        prompt_metadata: optional dict per prompt (e.g. ``{"answer": 42}``) given to reward functions.
    """

    def __init__(
        self,
        tokenizer,
        prompts: Sequence[str],
        max_length: int = 512,
        reward_fn: RewardFn | None = None,
        stop_sequences: Sequence[str] | None = None,
        temperature: float = 1.0,
        prompt_metadata: Sequence[Mapping[str, Any]] | None = None,
    ):
        if not prompts:
            raise ValueError("an environment needs at least one prompt")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        if prompt_metadata is not None and len(prompt_metadata) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(prompt_metadata)} prompt_metadata entries")
        if isinstance(tokenizer, str):  # a name, so that YAML can build an environment (e.g. "byte")
            from aitraining_pl.models import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.prompt_metadata = [dict(m) for m in prompt_metadata] if prompt_metadata else [{} for _ in prompts]
        self._metadata_by_prompt = dict(zip(self.prompts, self.prompt_metadata))
        self.max_length = max_length
        self.reward_fn = reward_fn or word_count_reward
        self.stop_sequences = [s for s in (stop_sequences or []) if s]
        self.temperature = temperature
        self.last_components: dict[str, list[float]] = {}
        self._order = itertools.cycle(range(len(self.prompts)))
        self._prompt_ids: list[int] = []
        self._episode: dict | None = None

    # ------------------------------------------------------------------ scoring
    def truncate_at_stop(self, generated: str) -> tuple[str, bool]:
        """``generated`` cut before its first stop sequence, and whether one was found."""
        cut = min((i for i in (generated.find(s) for s in self.stop_sequences) if i >= 0), default=-1)
        return (generated[:cut], True) if cut >= 0 else (generated, False)

    def score(self, prompt: str, generated: str, metadata: dict | None = None) -> tuple[float, dict[str, float]]:
        generated, _ = self.truncate_at_stop(generated)
        metadata = self.metadata_for(prompt) if metadata is None else metadata
        return call_reward_fn(self.reward_fn, prompt, generated, prompt + generated, metadata), {}

    def metadata_for(self, prompt: str) -> dict:
        """The metadata given with ``prompt`` at construction ({} for an unknown prompt)."""
        return self._metadata_by_prompt.get(prompt, {})

    # ------------------------------------------------------------------ episodes
    def _encode_prompt(self, prompt: str) -> list[int]:
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        eos = self.tokenizer.eos_token_id
        if ids and eos is not None and ids[-1] == eos and len(ids) > 1:
            ids = ids[:-1]  # tokenizers such as T5's append EOS to every text; a prompt must not end the episode
        return ids[-(self.max_length - 1) :]

    def _observation(self) -> Observation:
        ep = self._episode
        ids = torch.tensor([self._prompt_ids + ep["tokens"]], dtype=torch.long)
        meta = {**ep["metadata"], "generated_text": ep["text"], "num_generated": len(ep["tokens"])}
        return Observation(ids, torch.ones_like(ids), ep["prompt"], meta)

    def reset(self, index: int | None = None) -> Observation:
        """Start an episode on the next prompt (or prompt ``index``)."""
        index = next(self._order) if index is None else index
        prompt = self.prompts[index]
        self._prompt_ids = self._encode_prompt(prompt)
        self._episode = {
            "prompt": prompt,
            "metadata": dict(self.prompt_metadata[index]),
            "tokens": [],
            "end_ids": [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id],
            "text": "",
            "done": False,
            "observations": [],
            "actions": [],
            "rewards": [],
            "logprobs": [],
            "metrics": {},
        }
        obs = self._observation()
        self._episode["observations"].append(obs)
        return obs

    def _require_running(self) -> dict:
        if self._episode is None:
            raise RuntimeError("call reset() before step()")
        if self._episode["done"]:
            raise RuntimeError("the episode has ended; call reset() to start a new one")
        return self._episode

    def _append(self, tokens: list[int]) -> str | None:
        """Add tokens to the response; the stop reason if the episode ends."""
        ep = self._episode
        room = self.max_length - len(self._prompt_ids) - len(ep["tokens"])
        ends = ep["end_ids"]
        reason = None
        first_end = next((i for i, t in enumerate(tokens) if t in ends), None)
        if first_end is not None:
            tokens, reason = tokens[: first_end + 1], "eos"
        if len(tokens) > room:
            tokens, reason = tokens[:room], "max_length"  # an EOS beyond the room was cut away too
        elif len(tokens) == room and reason is None:
            reason = "max_length"
        ep["tokens"].extend(tokens)
        body = [t for t in ep["tokens"] if t not in ends]
        text, stopped = self.truncate_at_stop(self.tokenizer.decode(body, skip_special_tokens=True))
        ep["text"] = text
        if stopped:
            reason = "stop_sequence"
        return reason

    def step(self, action: Any, logprob: torch.Tensor | None = None) -> StepResult:
        """Append one token or a chunk; ``logprob`` (optional) is kept in the trajectory."""
        ep = self._require_running()
        tokens = as_token_list(action)
        if not tokens:
            raise ValueError("step() needs at least one token")
        reason = self._append(tokens)
        ep["actions"].append(torch.tensor(tokens, dtype=torch.long))
        if logprob is not None:
            ep["logprobs"].append(torch.as_tensor(logprob))
        info = {"prompt": ep["prompt"], "generated_text": ep["text"], "stop_reason": reason}
        if reason is None:
            ep["rewards"].append(0.0)
            obs = self._observation()
            ep["observations"].append(obs)
            return StepResult(0.0, False, obs, info, {})
        ep["done"] = True
        total, components = self.score(ep["prompt"], ep["text"], ep["metadata"])
        metrics = {f"reward_{name}": value for name, value in components.items()}
        metrics.update(reward_total=total, response_tokens=float(len(ep["tokens"])))
        ep["rewards"].append(total)
        ep["metrics"] = metrics
        return StepResult(total, True, None, info, metrics)

    def sample_action(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample one token id from next-token ``logits`` (V,) or (1, V) at the environment's temperature
        (greedy at temperature 0)."""
        logits = logits.reshape(-1).float()
        if self.temperature <= 0:
            return logits.argmax()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[0]

    @torch.no_grad()
    def rollout(
        self, model: torch.nn.Module, index: int | None = None, generator: torch.Generator | None = None
    ) -> Trajectory:
        """Play one episode with a causal LM through the rollout engine (``aitraining_pl.rollout``): the response
        is sampled with a KV cache at the environment's temperature (greedy at 0) and ends at an end token (the
        tokenizer's EOS or one of the model's ``generation_config.eos_token_id``), a stop sequence or
        ``max_length``; each token is then stepped through the environment with its log-probability at that
        temperature. ``generator`` seeds the sampling (the global RNG is then left untouched)."""
        obs = self.reset(index)
        self._episode["end_ids"] = end_token_ids(self.tokenizer, model)
        greedy = self.temperature <= 0
        config = GenerationConfig(
            max_new_tokens=self.max_length - len(self._prompt_ids),
            temperature=1.0 if greedy else self.temperature,
            do_sample=not greedy,
            stop_strings=self.stop_sequences or None,
        )
        engine = RolloutEngine(self.tokenizer, config, end_token_ids=self._episode["end_ids"], skip_special_tokens=True)
        device = next(model.parameters()).device
        ids, mask = obs.input_ids.to(device), obs.attention_mask.to(device)
        sampled = engine.sample(model, ids, mask, with_logprobs=True, seed=generator)
        logprobs = sampled.logprobs if greedy else sampled.sampling_logprobs  # at the environment's temperature
        for t in range(int(sampled.response_mask[0].sum())):
            if self.step(sampled.response_ids[0, t].cpu(), logprob=logprobs[0, t].cpu()).done:
                break
        return self.trajectory

    @property
    def trajectory(self) -> Trajectory:
        """The current (or last) episode."""
        ep = self._episode
        if ep is None:
            raise RuntimeError("no episode yet; call reset()")
        return Trajectory(
            list(ep["observations"]),
            list(ep["actions"]),
            list(ep["rewards"]),
            list(ep["logprobs"]),
            ep["done"],
            float(sum(ep["rewards"])),
            dict(ep["metrics"]),
        )

    def render(self) -> str:
        if self._episode is None:
            return "<no episode: call reset()>"
        ep = self._episode
        status = f"[done, reward={ep['rewards'][-1]:.4f}]" if ep["done"] else "[running]"
        return f"Prompt: {ep['prompt']}\nGenerated: {ep['text']}\n{status}"


class MultiObjectiveRewardEnv(TextGenerationEnv):
    """A ``TextGenerationEnv`` whose reward is a weighted sum of named components.

    At the end of an episode ``metrics["reward_<name>"]`` holds each component's raw score and
    ``metrics["reward_total"]`` the weighted sum; as a reward source, ``last_components`` holds the raw
    scores per component.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompts: the prompts of the episodes.
        reward_components: name -> ``fn(prompt, generated, full_text) -> float`` (``metadata=`` if taken).
        reward_weights: name -> weight; a component without a weight gets 1.0.
        **kwargs: the other ``TextGenerationEnv`` arguments (``max_length``, ``stop_sequences``, ...).
    """

    def __init__(
        self,
        tokenizer,
        prompts: Sequence[str],
        reward_components: Mapping[str, RewardFn],
        reward_weights: Mapping[str, float] | None = None,
        **kwargs: Any,
    ):
        if not reward_components:
            raise ValueError("MultiObjectiveRewardEnv needs at least one reward component")
        unknown = set(reward_weights or {}) - set(reward_components)
        if unknown:
            raise ValueError(
                f"reward_weights name unknown components {sorted(unknown)}; known: {sorted(reward_components)}"
            )
        if "total" in reward_components:
            raise ValueError("'total' is reserved for the weighted sum; rename that component")
        super().__init__(tokenizer, prompts, **kwargs)
        self.reward_components = dict(reward_components)
        self.reward_weights = {name: float((reward_weights or {}).get(name, 1.0)) for name in reward_components}

    def score(self, prompt: str, generated: str, metadata: dict | None = None) -> tuple[float, dict[str, float]]:
        generated, _ = self.truncate_at_stop(generated)
        metadata = self.metadata_for(prompt) if metadata is None else metadata
        full_text = prompt + generated
        parts = {
            name: call_reward_fn(fn, prompt, generated, full_text, metadata)
            for name, fn in self.reward_components.items()
        }
        return sum(self.reward_weights[name] * value for name, value in parts.items()), parts


def __getattr__(name: str) -> Any:
    if name == "length_reward":  # renamed in 0.2 (aitraining_pl.rewards had a length_reward counting characters)
        import warnings

        warnings.warn(
            "aitraining_pl.environments.length_reward is deprecated and will be removed in the next release: use "
            "aitraining_pl.environments.word_count_reward (the same function)",
            DeprecationWarning,
            stacklevel=2,
        )
        return word_count_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
