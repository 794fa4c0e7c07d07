"""Sampling of one sequence for the forward/backward pipeline (through the rollout engine), returning per-token
log-probs; ``filter_logits`` (``generation.hf.decoding``) is the top-k / top-p rule the engine applies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aitraining_pl.generation.hf.decoding import filter_logits
from aitraining_pl.rollout import GenerationConfig, RolloutEngine

__all__ = ["GREEDY_TEMPERATURE", "filter_logits", "sample_with_cache"]

#: temperatures at or below this sample greedily (argmax).
GREEDY_TEMPERATURE = 1e-4


def _stop_sequences(stop: Sequence[int | Sequence[int]] | None) -> list[list[int]]:
    return [
        [int(s)] if isinstance(s, int) or (torch.is_tensor(s) and s.dim() == 0) else [int(t) for t in s]
        for s in (stop or [])
    ]


@torch.no_grad()
def sample_with_cache(
    model: Any,
    prompt: Sequence[int],
    max_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: Sequence[int | Sequence[int]] | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Sample up to ``max_tokens`` after ``prompt`` from a transformers causal LM with the rollout engine
    (``aitraining_pl.rollout.RolloutEngine``: ``generate`` with a KV cache and an explicit sampling config).

    Sampling stops after a token (or token sequence) in ``stop``; the stop tokens are included. Temperatures at
    or below ``GREEDY_TEMPERATURE`` decode greedily.

    Returns:
        ``tokens`` (new token ids), ``logprobs`` (log-prob of each new token under the model itself, i.e.
        temperature 1 and no filtering, what training losses compute), ``sampling_logprobs`` (under the
        distribution actually sampled from; 0.0 for greedy steps), ``prompt`` (the prompt ids) and
        ``stop_reason`` (``"stop"`` or ``"length"``).
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("sample() needs a non-empty prompt")
    if max_tokens < 1:
        return {"tokens": [], "logprobs": [], "sampling_logprobs": [], "prompt": prompt, "stop_reason": "length"}
    stops = _stop_sequences(stop)
    greedy = temperature <= GREEDY_TEMPERATURE
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        temperature=1.0 if greedy else temperature,
        top_k=top_k,
        top_p=top_p,
        do_sample=not greedy,
    )
    engine = RolloutEngine(
        None,
        config,
        end_token_ids=[s[0] for s in stops if len(s) == 1],
        stop_sequences=[s for s in stops if len(s) > 1],
        warn_truncation=False,  # sampling_logprobs are exact
    )
    ids = torch.tensor([prompt], dtype=torch.long, device=device or next(model.parameters()).device)
    rollout = engine.sample(model, ids, torch.ones_like(ids), with_logprobs=True, seed=generator)
    n = int(rollout.response_mask[0].sum())
    sampling = [0.0] * n if greedy else rollout.sampling_logprobs[0, :n].tolist()
    return {
        "tokens": rollout.response_ids[0, :n].tolist(),
        "logprobs": rollout.logprobs[0, :n].tolist(),
        "sampling_logprobs": sampling,
        "prompt": prompt,
        "stop_reason": "stop" if bool(rollout.ended[0]) else "length",
    }
