"""The clipped policy-gradient loss of online RL: PPO and the critic-free family (GRPO, Dr. GRPO, DAPO, RLOO,
REINFORCE++) share it.

Per token: ``l_t = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) + beta * KL_t`` with
``rho = exp(logp - old_logp)`` (PPO's surrogate, Schulman et al. 2017; DAPO's clip-higher ``eps_high``,
Yu et al. 2025) and, when the KL is in the loss, GRPO's k3 estimate of KL(pi || ref) (Shao et al. 2024), optionally
weighted by the importance ratio (DeepSeek-V3.2's bias-corrected KL, ``use_bias_correction_kl``).
The per-token losses are reduced by a registered aggregation. GSPO's sequence-level ratio, CISPO's surrogate,
the two-sided ``delta`` bound and per-token weights (the high-entropy mask) come from ``policy_options``. When the
responses were sampled by another policy than the trainer's (vLLM's numerics, older weights), the policy term of
each token may also be weighted by an importance weight of ``pi_trainer / pi_sampler`` (``token_weights``, from
``off_policy.off_policy_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from aitraining_pl.losses.policy_options import IMPORTANCE_SAMPLING_LEVELS, POLICY_LOSSES
from aitraining_pl.losses.rl import kl_penalty


def sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """GRPO (Shao et al. 2024): mean over each response's tokens, then over the responses that have a token in the
    mask. A row with an empty mask (a group dropped by ``dynamic_sampling``, a response cut by
    ``mask_truncated_completions``) is left out of the mean, not counted as 0: with one empty row of eight the
    loss is the mean of the seven others, 8/7 of TRL 1.16's ``loss_type: grpo`` (which divides by all N rows).
    Chosen so that the gradient's scale does not shrink with the share of responses the filters drop (each kept
    response weighs 1 / kept, as DAPO's filtered batch and the ``token`` aggregation's normaliser have it)."""
    lengths = mask.sum(1)
    rows = lengths > 0
    if not rows.any():
        return (per_token * mask).sum()
    return ((per_token * mask).sum(1)[rows] / lengths[rows]).mean()


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """DAPO (Yu et al. 2025): mean over all tokens of the batch, so long responses weigh by their length."""
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def constant_normaliser(per_token: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): sum over tokens divided by a constant, rows x ``max_length`` (the
    generation budget), so no response length biases the gradient."""
    return (per_token * mask).sum() / (per_token.shape[0] * max_length)


#: The ``loss_aggregation`` values, as a type; equal to the keys of ``LOSS_AGGREGATIONS`` (tested).
LossAggregation = Literal["sequence", "token", "constant"]

LOSS_AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "sequence": sequence_mean,
    "token": token_mean,
    "constant": constant_normaliser,
}


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    aggregation: str = "sequence",
    max_length: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    loss_type: str = "clip",
    importance_sampling_level: str = "token",
    delta: float | None = None,
    token_weights: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss with optional k3 KL term, reduced by ``aggregation``.

    Args:
        logprobs, old_logprobs, advantages, mask: (N, R).
        epsilon: lower clip range (``rho >= 1 - epsilon``). epsilon_high: upper one (default ``epsilon``).
        aggregation: a key of ``LOSS_AGGREGATIONS``. max_length: normaliser of ``constant`` (default R).
        ref_logprobs: reference log-probs; with ``kl_coef > 0`` adds ``kl_coef * k3`` per token.
        loss_type: a key of ``policy_options.POLICY_LOSSES`` (``clip`` or ``cispo``).
        importance_sampling_level: a key of ``policy_options.IMPORTANCE_SAMPLING_LEVELS`` (``token``, or GSPO's
            ``sequence``). delta: upper bound on the unclipped ratio (``clip`` only; None: none).
        token_weights: (N, R) multiplies the policy term per token (e.g. ``policy_options.high_entropy_mask``);
            the KL term and the aggregation's normaliser keep ``mask``.
        use_bias_correction_kl: multiply each token's k3 by the importance ratio ``pi_theta / pi_old`` of
            ``importance_sampling_level`` (not detached; DeepSeek-V3.2, 2025; TRL's ``use_bias_correction_kl``), so
            the KL term's gradient is the unbiased gradient of KL(pi || ref) (plain k3's is that of KL(ref || pi)).

    Returns:
        ``(loss, stats)``; stats (detached): ``clipfrac/low`` (share of tokens with A < 0 whose ratio is
        below ``1 - epsilon``), ``clipfrac/high`` (A > 0, ratio above ``1 + epsilon_high``), ``clipfrac``
        (either: the share of tokens where the clipped term is the larger one, so its gradient is 0),
        ``approx_kl`` (k3 estimate of KL(old || new), Schulman 2020) and ``kl`` (mean per-token k3 to the
        reference as it enters the loss, bias-corrected when asked; when one is given). With
        ``aggregation="token"`` and no KL term this is PPO's policy loss.
    """
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    for name, value, known in (
        ("loss_type", loss_type, POLICY_LOSSES),
        ("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS),
    ):
        if value not in known:
            raise ValueError(f"unknown {name} {value!r}; known: {', '.join(known)}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logprobs.dtype)
    log_ratio = IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level](logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    per_token = POLICY_LOSSES[loss_type](ratio, logprobs, advantages, epsilon, epsilon_high, delta)
    if token_weights is not None:
        per_token = per_token * token_weights
    kl = None
    if ref_logprobs is not None and kl_coef:
        kl = kl_penalty(logprobs, ref_logprobs, "k3")
        if use_bias_correction_kl:  # the samples came from pi_old: weight by pi_theta / pi_old, gradient kept
            kl = kl * ratio
        per_token = per_token + kl_coef * kl
    loss = LOSS_AGGREGATIONS[aggregation](per_token, mask, max_length or mask.shape[1])
    with torch.no_grad():
        token_ratio = logprobs - old_logprobs
        n = mask.sum().clamp_min(1.0)
        low = ((ratio < 1 - epsilon) & (advantages < 0)).to(mask.dtype) * mask
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype) * mask
        stats = {
            "clipfrac/low": low.sum() / n,
            "clipfrac/high": high.sum() / n,
            "clipfrac": (low + high).sum() / n,
            "approx_kl": ((torch.expm1(token_ratio) - token_ratio) * mask).sum() / n,
        }
        if kl is not None:
            stats["kl"] = (kl * mask).sum() / n
    return loss, stats
