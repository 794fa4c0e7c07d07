"""Sampling from a vision-language model with the KV-cache decoder: each prompt, with its images, runs through the
model once (the vision encoder once per prompt); its cache then serves all ``G`` samples.

The prefill is the model's forward on the B prompts with their pixel values; its KV cache (image tokens included)
is repeated for the samples (``DynamicCache.batch_repeat_interleave``), and every later step feeds text tokens
only, so no pixel value is ever held or encoded ``G`` times. Image and video tokens are never sampled
(``image_token_ids``): a response holding one would be a placeholder without an image. Positions continue where
the prompt's ended: for the Qwen VL family's multimodal RoPE the model's own ``rope_deltas`` shift the text
positions after the images, for the others the count of real tokens (as ``generate`` counts left-padded rows).
The steps are ``generation.hf.decoding.sample_steps``, the loop the text decoder runs (ended rows leave the batch).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from aitraining_pl.generation.backend import SampledTokens, StopRule
from aitraining_pl.generation.hf.decoding import DecodeBatch, Forward, plain_cache, sample_steps
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.routing_replay import joined_routes, recording
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import VisionInputs, image_token_ids, model_inputs, uses_mrope


class _Banned:
    """A ``Forward`` whose logits give ``ids`` no probability."""

    def __init__(self, forward: Forward, ids: list[int]):
        self.forward, self.ids = forward, ids

    def __call__(self, *args, **kwargs):
        logits, cache = self.forward(*args, **kwargs)
        logits[:, self.ids] = float("-inf")
        return logits, cache


def _prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, vision: VisionInputs, num_samples: int):
    """The prompts (B, P) with their images through the model once, the cache repeated for ``num_samples`` rows
    per prompt (``DecodeBatch`` of N = B * G rows)."""
    kwargs = model_inputs(model, prompt_ids, prompt_mask, vision)
    forward = Forward(model)
    extra = {} if not forward.keep_last else {"logits_to_keep": 1}
    base = getattr(base_model(model), "model", None)
    if uses_mrope(model):
        base.rope_deltas = None  # deltas of an earlier batch would be reused (none are set without images)
    out = model(**kwargs, use_cache=True, **extra)
    cache = out.get("cache")
    if cache is None:
        cache = out.get("past_key_values")
    if not plain_cache(cache):
        raise NotImplementedError(f"{type(base_model(model)).__name__}: sampling with images needs a DynamicCache")
    if uses_mrope(model) and base.rope_deltas is not None:  # the last prompt position: shifted past the images
        position = prompt_mask.sum(1, keepdim=True) - 1 + base.rope_deltas.to(prompt_mask.device)
    else:
        position = positions_from_mask(prompt_mask)[:, -1:]
    logits, mask = out.logits[:, -1].to(copy=True, dtype=torch.float32), prompt_mask
    banned = image_token_ids(model)
    logits[:, banned] = float("-inf")
    if num_samples > 1:
        cache.batch_repeat_interleave(num_samples)
        logits, mask, position = (t.repeat_interleave(num_samples, 0) for t in (logits, mask, position))
    return _Banned(forward, banned), DecodeBatch(logits, cache, mask, position)


@torch.no_grad()
def sample_with_images(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    vision: VisionInputs,
    generation: Any,
    end_ids: list[int],
    stop_rule: StopRule | None,
    pad_token_id: int,
    num_samples: int = 1,
    seed: int | None = None,
    with_logprobs: bool = False,
    chosen_logprobs: bool = False,
    record_routes: bool = False,
) -> SampledTokens:
    """``num_samples`` responses per left-padded prompt (B, P) with its images (``vision``, one entry per prompt)
    and ``generation`` (a ``GenerationConfig``), in eval mode, seeded by ``seed`` in a forked RNG when given; rows
    in ``repeat_interleave`` order, as the text backends return them (``generation.hf.backend.HFBackend.sample``);
    ``with_logprobs``: the logits kept (``Rollout.logprobs`` and ``sampling_logprobs``); ``chosen_logprobs``: the
    drawn tokens' log-probs only (``sampling_logprobs``, a server's: never N x R x V); ``record_routes``: an MoE
    language model's routes too (``SampledTokens.routes``, image tokens included: ``models.routing_replay``)."""
    config = hf_generation_config(generation, end_ids, pad_token_id, with_logprobs)
    devices = [prompt_ids.device] if prompt_ids.device.type == "cuda" else []
    seeded = torch.random.fork_rng(devices=devices) if seed is not None else contextlib.nullcontext()
    with seeded, eval_mode(model):
        if seed is not None:
            torch.manual_seed(seed)
        with recording(model) if record_routes else contextlib.nullcontext() as recorder:
            forward, batch = _prefill(model, prompt_ids, prompt_mask, vision, num_samples)
            prompt_routes = recorder.take() if recorder is not None else None
            drawn = sample_steps(forward, batch, config, stop_rule, chosen_logprobs=chosen_logprobs, recorder=recorder)
    routes = None
    if recorder is not None and drawn.routes is not None:
        routes = joined_routes(prompt_routes, prompt_mask, num_samples, drawn.routes)
    chosen = drawn.chosen if chosen_logprobs else None
    return SampledTokens(drawn.tokens, drawn.logits, drawn.scores, chosen, routes=routes)
