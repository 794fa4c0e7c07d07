"""The generation-backend seam: what the rollout engine asks of whatever samples its responses.

A backend turns left-padded prompts into ``SampledTokens`` under an explicit ``GenerationConfig`` and ``StopRule``;
the rollout engine (``aitraining_pl.rollout``) turns those into a ``Rollout`` by one rule, whichever backend ran.
Around each rollout the owner calls ``sync(policy, version)`` (make the policy's current weights the sampler's) and
``sleep()`` (release what sampling held); ``close()`` at teardown. ``location`` says where sampling runs:

- ``policy``: the policy itself samples, in this process (``generation.hf.backend.HFBackend``: the KV-cache decoder of
  ``generation.hf.decoding``); nothing is pushed, and under FSDP2 ``sync`` gathers the full parameters for the rollout;
- ``colocated``: a separate engine in this process holds its own copy of the weights (``generation.vllm.VLLMEngine``);
- ``server``: other processes sample (``generation.servers.fleet.Fleet``: one generation server or several, over
  HTTP).

The backends are named in ``generation.registry.BACKENDS`` (one ``"module:Class"`` line each, imported only when
chosen) and built by ``generation.registry.build_backend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from aitraining_pl.generation.images import PromptImages
from aitraining_pl.models.vision import VisionInputs

Location = Literal["policy", "colocated", "server"]


class StopRule:
    """Stop strings and stop sequences of token ids, checked on the response tokens only.

    A response prefix ``ids`` stops when its decoding (special tokens decoded as their text) contains one of
    ``stop_strings``, or when it ends with one of ``stop_sequences``. ``generate`` checks every prefix as it
    grows (``ResponseStoppingCriteria``) and ``ends`` finds the first stopping prefix afterwards, so both agree.

    Args:
        tokenizer: decodes responses for ``stop_strings`` (may be None when there are none).
        stop_strings: texts that end a response.
        stop_sequences: token-id sequences that end a response.
        skip_special_tokens: look for stop strings in the text without special tokens (default: special tokens
            are decoded as their text, as transformers' own stop strings see them).
    """

    def __init__(
        self,
        tokenizer=None,
        stop_strings: Sequence[str] | None = None,
        stop_sequences: Sequence[Sequence[int]] | None = None,
        skip_special_tokens: bool = False,
    ):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.stop_strings = [s for s in (stop_strings or []) if s]
        self.stop_sequences = [[int(t) for t in s] for s in (stop_sequences or []) if len(s)]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def __bool__(self) -> bool:
        return bool(self.stop_strings or self.stop_sequences)

    def stops(self, ids: list[int]) -> bool:
        """Whether the response prefix ``ids`` has reached a stop."""
        if any(len(ids) >= len(s) and ids[-len(s) :] == s for s in self.stop_sequences):
            return True
        return bool(self.stop_strings) and self._contains_string(ids)

    def _contains_string(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return any(s in text for s in self.stop_strings)

    def ends(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(N,) index of the token at which a response first stops; -1 where it never does."""
        ends = torch.full((response_ids.shape[0],), -1, dtype=torch.long, device=response_ids.device)
        if not self:
            return ends
        for row, ids in enumerate(response_ids.tolist()):
            seq_hit = any(_find(ids, s) >= 0 for s in self.stop_sequences)
            if not (seq_hit or (self.stop_strings and self._contains_string(ids))):
                continue  # no prefix can stop if the whole response does not
            ends[row] = next(t for t in range(len(ids)) if self.stops(ids[: t + 1]))
        return ends


def _find(ids: list[int], seq: list[int]) -> int:
    """Start of the first occurrence of ``seq`` in ``ids``; -1 where none."""
    return next((i for i in range(len(ids) - len(seq) + 1) if ids[i : i + len(seq)] == seq), -1)


class SampledTokens(NamedTuple):
    """What a sampler returned: response ids (N, R) and, when asked, the per-step logits (N, R, V) before and
    after the sampling processors (temperature, top-k, top-p); a backend that returns no logits (vLLM) gives
    the sampled tokens' log-probs under the distribution sampled from (N, R) instead. A generation server also
    says which weights sampled each token (``token_versions``)."""

    response_ids: torch.Tensor
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    #: (N, R) int64: the step of the weights (version ``run:step``) that sampled each token, -1 after the end; one
    #: response may span two versions when a push landed while it was generated (``generation.servers.hf_server``)
    token_versions: torch.Tensor | None = None
    #: (N, P + R, layers, k) int16: the experts each prompt and response token was routed to by an MoE sampler
    #: (``models.routing_replay``), -1 where none (padding, a response's last token); None for a dense model
    routes: torch.Tensor | None = None


@dataclass
class BackendContext:
    """What a backend may need to be built: the policy it samples for, its tokenizer, and the run around it."""

    policy: torch.nn.Module
    tokenizer: Any = None
    rank: int = 0  #: this process's global rank
    run: str | None = None  #: one id for the run (the same on every rank): a server's weight versions belong to it
    seed: int = 0  #: the run's seed (engines that keep generators of their own seed them from it)
    precision: str | None = None  #: the trainer's precision flag (an engine's compute dtype follows it)
    max_prompt_length: int | None = None  #: the longest prompt in tokens (an engine's KV cache is sized by it)


@dataclass
class SampleRequest:
    """What one ``GenerationBackend.sample`` call is asked (an engine's ``sample_many`` serves several in one
    ``generate``; a server client sends one): ``num_samples`` responses for each left-padded prompt (B, P) under
    ``generation``, ended by ``end_ids`` / ``stop_rule``, right padded with ``pad_token_id``; ``seed``: a
    non-negative int that makes the draw reproducible (None: the backend's own generator); ``images``: a VL prompt's
    images for a backend that encodes them itself (vLLM, a server; ``generation.images``), None for text prompts;
    ``vision``: the same prompts' encoded images (``models.vision.VisionInputs``, one entry per prompt: pixel values)
    for a backend that runs the policy itself (``location`` ``policy``), None for text prompts; ``adapter``: the name
    of a LoRA adapter a ``vllm serve`` holds (pushed under that name: ``servers.adapters.AdapterWeights.name``) to
    sample with instead of the pushed weights (None: the pushed weights)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    generation: Any
    end_ids: Sequence[int]
    stop_rule: StopRule
    pad_token_id: int
    num_samples: int = 1
    seed: int | None = None
    images: PromptImages | None = None
    vision: VisionInputs | None = None
    adapter: str | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    """What samples the rollouts (see the module docstring)."""

    #: where sampling runs: ``policy`` (the policy itself), ``colocated`` (an engine in this process), ``server``
    location: Location

    def sample(self, request: SampleRequest) -> SampledTokens:
        """``request.num_samples`` responses per left-padded prompt (rows in ``repeat_interleave`` order);
        ``request.seed``: a non-negative int that makes the draw reproducible (None: the backend's own generator)."""
        ...

    def sync(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """Make ``policy``'s current weights (of ``version``, e.g. the optimizer step) the sampler's; True when
        weights were moved."""
        ...

    def sleep(self) -> None:
        """Release what sampling held until the next ``sync`` (a KV cache, gathered parameters)."""
        ...

    def close(self) -> None:
        """Free the backend for good (an engine, a connection)."""
        ...

    def stats(self) -> dict[str, torch.Tensor]:
        """Figures the trainer logs with each iteration, the same keys on every rank (a fleet's: servers up and
        per-server figures, ``generation.servers.fleet.Fleet.stats``); ``{}`` for a backend with none."""
        ...
