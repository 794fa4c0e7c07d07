"""What a rollout is, sampled and then scored.

``Rollout``: the rollout engine's answer (``rollout.engine``), N = B * G rows of prompt and response tokens with
their masks, ended flags and texts, and what the sampler knew (its log-probs, the weights version of each token, an
episode's holes). ``RolloutBatch``: the same rows as the online modules train on them, with their scores
(``RolloutBatch.from_rollout``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aitraining_pl.losses import place_scores


@dataclass
class Rollout:
    """Sampled responses of N = B * G rows; prompt ``i``'s samples are rows ``i*G .. i*G+G-1``."""

    prompt_ids: torch.Tensor  #: (N, P) left padded
    prompt_mask: torch.Tensor  #: (N, P)
    response_ids: torch.Tensor  #: (N, R) right padded after the end
    response_mask: torch.Tensor  #: (N, R) long, 1 up to and including the end token
    ended: torch.Tensor  #: (N,) bool: ended by an end token or stop (False: hit max_new_tokens)
    texts: list[str]  #: decoded responses (end/special tokens removed); empty strings without a tokenizer
    group: torch.Tensor  #: (N,) long: index of the prompt each row came from
    logprobs: torch.Tensor | None = None  #: (N, R) untruncated log-probs at temperature 1 (``with_logprobs``)
    #: (N, R) log-probs under the distribution sampled from, as the sampler computed them (``with_logprobs``;
    #: always from the vLLM backend, whose numerics differ from the trainer's), zero after each response
    sampling_logprobs: torch.Tensor | None = None
    #: (N, R) the weights version (step) that sampled each token, as a generation server reports it (-1 after the
    #: end); None from the other backends
    token_versions: torch.Tensor | None = None
    #: (N, P + R, layers, k) the experts an MoE sampler routed each token to (``SampledTokens.routes``), else None
    routes: torch.Tensor | None = None
    #: multi-turn episodes (``environments.episode_rollout.EpisodeInfo``): then ``response_mask`` marks the
    #: sampled tokens only and ``episodes.response_attention`` every real token (the environment's replies too)
    episodes: Any = None
    #: each row's images (``models.vision.VisionInputs``, one entry per row) where they differ by row: the episodes of
    #: a vision-language policy (the environment's and the agent's images); None: the prompts' (the batch's)
    vision: Any = None

    @property
    def input_ids(self) -> torch.Tensor:
        """(N, P + R) prompt and response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(N, P + R): the prompt mask, then the response mask (0 after the end); in an episode every real
        token after the prompt (``episodes.response_attention``)."""
        response = self.response_mask if self.episodes is None else self.episodes.response_attention
        return torch.cat([self.prompt_mask, response.to(self.prompt_mask.dtype)], dim=1)

    @property
    def num_samples(self) -> int:
        """G: samples per prompt."""
        return self.group.shape[0] // max(1, int(self.group.max()) + 1) if self.group.numel() else 0


@dataclass
class RolloutBatch:
    """Sampled and scored responses; per-token tensors are (N, R), N = prompts x samples per prompt."""

    input_ids: torch.Tensor  #: (N, P + R) prompt and response
    attention_mask: torch.Tensor  #: (N, P + R)
    prompt_length: int  #: P
    mask: torch.Tensor  #: (N, R) response mask (a prefix up to the end token; holes where an environment spoke)
    ended: torch.Tensor  #: (N,) ended by EOS / stop string (False: truncated at max_new_tokens)
    group: torch.Tensor  #: (N,) index of the prompt each row answers
    texts: list[str]
    scores: torch.Tensor  #: (N,) reward-source scores (minus the missing-EOS penalty); an episode's return
    components: dict[str, list[float]]
    token_scores: torch.Tensor | None = None  #: (N, R) an episode's per-turn rewards on each turn's last token
    episode_metrics: dict[str, list[float]] | None = None  #: per episode: turns, tool calls, ... (episodes only)
    sampling_logprobs: torch.Tensor | None = None  #: (N, R) the sampler's log-probs (vLLM backend), else None
    token_versions: torch.Tensor | None = None  #: (N, R) the weights version of each sampled token (a server)
    episode: torch.Tensor | None = None  #: (N,) the episode of each row where an episode gives several (agents)
    vision: Any = None  #: the images of each row's prompt (``models.vision.VisionInputs``), for VL models
    routes: torch.Tensor | None = None  #: (N, P + R, layers, k) an MoE sampler's routes (``Rollout.routes``)

    @classmethod
    def from_rollout(
        cls, rollout: Rollout, scores: torch.Tensor, components: dict[str, list[float]] | None = None, **fields: Any
    ) -> RolloutBatch:
        """The batch of ``rollout`` scored ``scores`` (N,) with ``components``: its tokens, masks, ended flags,
        groups, texts, the sampler's log-probs and per-token versions; ``fields`` set the others (an episode's
        ``token_scores``, ...) or replace these."""
        copied = dict(
            sampling_logprobs=rollout.sampling_logprobs, token_versions=rollout.token_versions, routes=rollout.routes
        )
        return cls(
            rollout.input_ids,
            rollout.attention_mask,
            rollout.prompt_ids.shape[1],
            rollout.response_mask,
            rollout.ended,
            rollout.group,
            rollout.texts,
            scores,
            {} if components is None else components,
            **{**copied, **fields},
        )

    def placed_scores(self) -> torch.Tensor:
        """(N, R) the scores on the tokens they reward: per turn in an episode, else on the last token."""
        return self.token_scores if self.token_scores is not None else place_scores(self.scores, self.mask)
