"""Rollouts for PPO: sampling responses, response masks, and per-token rewards.

Shapes: B prompts, P prompt tokens (left padded), R response tokens (right padded after the end).
A response ends at its first EOS token (included: it is the action that ends the episode), or at the token
that completes a configured stop string, or at ``max_new_tokens``. The response mask is 1 on tokens up to and
including the end and 0 after it, so it is always a non-empty prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from aitraining_pl.losses import kl_penalty


@dataclass
class GenerationConfig:
    """How responses are sampled (Hugging Face ``generate`` with a KV cache)."""

    max_new_tokens: int = 128
    """Longest response, in tokens."""
    temperature: float = 0.7
    """Sampling temperature; log-probs for the PPO ratio use the same temperature."""
    top_p: float = 0.9
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off)."""
    stop_strings: Optional[list[str]] = None
    """Strings that end a response (the response keeps them), besides the EOS token."""
    do_sample: bool = True
    """False: greedy decoding (for evaluation)."""


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over attended tokens (``cumsum - 1``, 0 on padding), as ``generate`` uses them
    for left-padded prompts. (B, T) -> (B, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
    *,
    eos_token_id: int,
    pad_token_id: int,
    tokenizer=None,
    synced_gpus: bool = False,
) -> torch.Tensor:
    """Response tokens (B, R) sampled by ``model.generate`` for left-padded ``prompt_ids`` (B, P).

    ``model`` must be the plain (unwrapped) transformers or peft model. ``tokenizer`` is needed for
    ``stop_strings``; ``synced_gpus`` keeps ranks stepping together under FSDP / ZeRO-3.
    """
    kwargs = dict(
        max_new_tokens=config.max_new_tokens,
        do_sample=config.do_sample,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
        synced_gpus=synced_gpus,
    )
    if config.do_sample:
        kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or None)
    else:  # silence generation-config warnings about sampling options under greedy decoding
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if config.stop_strings:
        kwargs.update(stop_strings=list(config.stop_strings), tokenizer=tokenizer)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
    return out[:, prompt_ids.shape[1] :]


def response_mask(
    response_ids: torch.Tensor, eos_token_id: int | Sequence[int], stop_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of response tokens up to and including the first EOS (or the stop-string end, if earlier).

    Args:
        response_ids: (B, R).
        eos_token_id: one id or several.
        stop_ends: optional (B,) index of the token that completes a stop string, -1 where none.

    Returns:
        ``(mask, ended)``: (B, R) long mask; (B,) bool, True where the response ended by EOS or stop string
        (False: truncated at ``max_new_tokens``).
    """
    eos = torch.as_tensor(eos_token_id, device=response_ids.device).view(-1)
    is_end = torch.isin(response_ids, eos)
    if stop_ends is not None:
        positions = torch.arange(response_ids.shape[1], device=response_ids.device)
        is_end = is_end | ((positions[None, :] == stop_ends[:, None]) & (stop_ends[:, None] >= 0))
    ended = is_end.any(dim=1)
    last = torch.where(ended, is_end.long().argmax(dim=1), torch.full_like(ended, response_ids.shape[1] - 1, dtype=torch.long))
    mask = torch.arange(response_ids.shape[1], device=response_ids.device)[None, :] <= last[:, None]
    return mask.long(), ended


def stop_string_ends(tokenizer, response_ids: torch.Tensor, stop_strings: Sequence[str]) -> torch.Tensor:
    """(B,) index of the token whose decoding first completes one of ``stop_strings``; -1 where none.

    Special tokens are decoded as their text, as ``generate``'s stop-string check sees them.
    """
    ends = torch.full((response_ids.shape[0],), -1, dtype=torch.long, device=response_ids.device)
    for row, ids in enumerate(response_ids.tolist()):
        if not any(s in tokenizer.decode(ids) for s in stop_strings):
            continue
        for t in range(1, len(ids) + 1):  # the shortest prefix that contains a stop string
            if any(s in tokenizer.decode(ids[:t]) for s in stop_strings):
                ends[row] = t - 1
                break
    return ends


def decode_responses(tokenizer, response_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Texts of the masked response tokens, special tokens (EOS) removed."""
    return [tokenizer.decode(ids[: int(n)], skip_special_tokens=True) for ids, n in zip(response_ids.tolist(), mask.sum(1))]


def place_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence score on its response's last token (the EOS itself when there is one).

    Args:
        scores: (B,). mask: (B, R) prefix mask.

    Returns:
        (B, R) zeros except ``scores[b]`` at index ``mask[b].sum() - 1``.
    """
    placed = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    last = (mask.sum(dim=1) - 1).clamp_min(0).long()
    placed[torch.arange(mask.shape[0], device=mask.device), last] = scores
    return placed


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of KL-regularised RLHF (Ziegler et al. 2019; Stiennon et al. 2020):
    ``r_t = -kl_coef * KL_t`` plus the sequence score on the last response token.

    Args:
        scores: (B,) reward-source scores. logprobs, ref_logprobs, mask: (B, R).

    Returns:
        ``(rewards, kl)``: (B, R) each, zero outside the mask; ``kl`` is the per-token estimate in nats.
    """
    mask = mask.to(logprobs.dtype)
    kl = kl_penalty(logprobs, ref_logprobs, estimator) * mask
    return (-kl_coef * kl + place_scores(scores.to(logprobs.dtype), mask)) * mask, kl
