"""The HF backend: the policy samples itself, in this process, with this project's KV-cache decoder
(``generation.hf.decoding``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from aitraining_pl.generation.backend import BackendContext, Location, SampledTokens, SampleRequest
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.hf.decoding import sample_responses
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.generation.hf.vision_decoding import sample_with_images
from aitraining_pl.models.sharding import gathered
from aitraining_pl.models.training import eval_mode


class HFBackend:
    """The policy samples itself with this project's KV-cache decoder (``generation.hf.decoding.sample_responses``, or
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
        record = bool(getattr(r.generation, "routing_replay", False))
        if r.vision is not None:  # prompts with images: the VL decoder, with their pixel values
            args = r.generation, r.end_ids, r.stop_rule, r.pad_token_id, r.num_samples, r.seed, self.with_logprobs
            return sample_with_images(self.model, r.prompt_ids, r.prompt_mask, r.vision, *args, record_routes=record)
        config = hf_generation_config(r.generation, r.end_ids, r.pad_token_id, self.with_logprobs)
        devices = [r.prompt_ids.device] if r.prompt_ids.device.type == "cuda" else []
        seeded = torch.random.fork_rng(devices=devices) if r.seed is not None else contextlib.nullcontext()
        with seeded, eval_mode(self.model):
            if r.seed is not None:
                torch.manual_seed(r.seed)
            return sample_responses(
                self.model,
                r.prompt_ids,
                r.prompt_mask,
                config,
                r.stop_rule,
                r.generation.drop_ended,
                r.num_samples,
                record,
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

    def stats(self) -> dict[str, torch.Tensor]:
        """None to log (``GenerationBackend.stats``)."""
        return {}
