"""The generation-backend seam: what the rollout engine asks of whatever samples its responses.

A backend turns left-padded prompts into ``SampledTokens`` under an explicit ``GenerationConfig`` and ``StopRule``;
the rollout engine (``aitraining_pl.rollout``) turns those into a ``Rollout`` by one rule, whichever backend ran.
Around each rollout the owner calls ``sync(policy, version)`` (make the policy's current weights the sampler's) and
``sleep()`` (release what sampling held); ``close()`` at teardown. ``location`` says where sampling runs:

- ``policy``: the policy itself samples, in this process (``HFBackend``: the KV-cache decoder of
  ``models.decoding``); nothing is pushed, and under FSDP2 ``sync`` gathers the full parameters for the rollout;
- ``colocated``: a separate engine in this process holds its own copy of the weights (``generation.vllm.VLLMEngine``);
- ``server``: other processes sample (``generation.servers.fleet.Fleet``: one generation server or several, over
  HTTP).

The backends are named in ``generation.registry.BACKENDS`` (one ``"module:Class"`` line each, imported only when
chosen) and built by ``generation.registry.build_backend``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.images import PromptImages
from aitraining_pl.models.decoding import sample_responses
from aitraining_pl.models.generation import SampledTokens, StopRule, hf_generation_config
from aitraining_pl.models.sharding import gathered
from aitraining_pl.models.training import eval_mode

Location = Literal["policy", "colocated", "server"]


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
    images for a backend that encodes them itself (vLLM; ``generation.images``), None for text prompts."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    generation: Any
    end_ids: Sequence[int]
    stop_rule: StopRule
    pad_token_id: int
    num_samples: int = 1
    seed: int | None = None
    images: PromptImages | None = None


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


class HFBackend:
    """The policy samples itself with this project's KV-cache decoder (``models.decoding.sample_responses``, or
    transformers' ``generate`` where the model has no plain cache or ``drop_ended`` is off), in eval mode.

    Args:
        model: the plain (unwrapped) transformers or peft causal LM that samples.
        with_logprobs: also return the logits and processed scores of the sampled tokens (``SampledTokens``).
    """

    location: Location = "policy"

    def __init__(self, model: torch.nn.Module, with_logprobs: bool = False):
        self.model, self.with_logprobs = model, with_logprobs
        self._held = contextlib.ExitStack()

    @classmethod
    def from_context(cls, generation: GenerationConfig, context: BackendContext) -> HFBackend:
        return cls(context.policy)

    def sample(self, request: SampleRequest) -> SampledTokens:
        r = request
        config = hf_generation_config(r.generation, r.end_ids, r.pad_token_id, self.with_logprobs)
        devices = [r.prompt_ids.device] if r.prompt_ids.device.type == "cuda" else []
        seeded = torch.random.fork_rng(devices=devices) if r.seed is not None else contextlib.nullcontext()
        with seeded, eval_mode(self.model):
            if r.seed is not None:
                torch.manual_seed(r.seed)
            return sample_responses(
                self.model, r.prompt_ids, r.prompt_mask, config, r.stop_rule, r.generation.drop_ended, r.num_samples
            )

    def sync(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """Sample with ``policy`` itself: nothing moves; a sharded policy's full parameters are gathered until
        ``sleep`` (FSDP2: one all-gather per rollout, not one per generated token)."""
        self.sleep()
        self.model = policy
        self._held.enter_context(gathered(policy))
        return False

    def sleep(self) -> None:
        self._held.close()

    def close(self) -> None:
        self.sleep()
