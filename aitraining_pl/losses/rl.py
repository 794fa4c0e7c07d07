"""Policy-gradient maths: KL estimators, reward shaping (scores on tokens, KL-penalised token rewards), GAE and
PPO's clipped value loss (the clipped policy loss is
``losses.policy_gradient.clipped_policy_loss``, the advantage estimators are in ``losses.advantages``).

Pure tensor functions. Per-token tensors are (B, T) with a (B, T) 0/1 ``mask`` marking response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from aitraining_pl.losses.logprobs import masked_mean

#: The ``kl_estimator`` values, as a type; equal to the keys of ``_KL_ESTIMATORS`` (tested).
KLEstimator = Literal["k1", "k2", "k3"]

_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # r = log ref - log pi on samples from pi; all three estimate KL(pi || ref) (Schulman 2020).
    "k1": lambda r: -r,
    "k2": lambda r: 0.5 * r**2,
    "k3": lambda r: torch.expm1(r) - r,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi (Schulman 2020,
    "Approximating KL divergence").

    ``k1 = log pi - log ref`` (unbiased, can be negative), ``k2 = (log pi - log ref)^2 / 2`` (biased, low
    variance), ``k3 = (ref/pi - 1) - log(ref/pi)`` (unbiased, always >= 0).

    Args:
        logprobs, ref_logprobs: (B, T) log-probs of the sampled tokens.

    Returns:
        (B, T) per-token KL estimates (in nats).
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(_KL_ESTIMATORS)}")
    return _KL_ESTIMATORS[estimator](ref_logprobs - logprobs)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), per token.

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``. The value after a
    response's last token is 0 (the episode ends there). Masked positions are skipped: ``t + 1`` is the next
    position inside the mask, so in a multi-turn episode (a mask with holes where the environment spoke) the
    recursion runs across the holes over the model's tokens only (Schulman et al. 2016 over agent steps; the
    environment's tokens are not actions). For a prefix mask this is the usual per-token GAE.

    Args:
        rewards, values, mask: (B, T).

    Returns:
        ``(advantages, returns)``, each (B, T), zero outside the mask; ``returns = advantages + values``.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_adv) * mask[:, t]
        inside = mask[:, t] > 0
        next_value = torch.where(inside, values[:, t], next_value)
        next_adv = torch.where(inside, advantages[:, t], next_adv)
    return advantages, (advantages + values) * mask


def ppo_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, value_clip: float
) -> torch.Tensor:
    """Clipped value loss (Schulman et al. 2017, as in OpenAI baselines):
    ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))`` over the mask."""
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def place_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence score on its response's last token (the end token itself when there is one).

    Args:
        scores: (B,). mask: (B, R) response mask (a prefix, or with holes where an environment spoke).

    Returns:
        (B, R) zeros except ``scores[b]`` at the last index where ``mask[b]`` is 1 (index 0 for an empty mask).
    """
    placed = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    index = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = ((mask != 0).long() * index).max(dim=1).values.sub(1).clamp_min(0)
    placed[torch.arange(mask.shape[0], device=mask.device), last] = scores
    return placed


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
    placed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of KL-regularised RLHF (Ziegler et al. 2019; Stiennon et al. 2020):
    ``r_t = -kl_coef * KL_t`` plus the sequence score on the last response token.

    Args:
        scores: (B,) reward-source scores. logprobs, ref_logprobs, mask: (B, R).
        placed: (B, R) scores already on their tokens (an episode's per-turn rewards), instead of ``scores``.

    Returns:
        ``(rewards, kl)``: (B, R) each, zero outside the mask; ``kl`` is the per-token estimate in nats.
    """
    mask = mask.to(logprobs.dtype)
    kl = kl_penalty(logprobs, ref_logprobs, estimator) * mask
    placed = place_scores(scores, mask) if placed is None else placed
    return (-kl_coef * kl + placed.to(logprobs.dtype)) * mask, kl
