"""Off-policy corrections: the responses were sampled by a *behaviour* policy ``pi_b`` (an inference engine's kernels
and precision, weights one or more versions old) while the loss is taken under the trainer's ``pi_old`` (the
trainer's log-probs of the same tokens at rollout time, the ratio's denominator). Each response token's policy term
is weighted by an importance weight derived from ``rho_t = pi_old(y_t) / pi_b(y_t)``, detached.

The modes (``IMPORTANCE_SAMPLING_MODES``; TRL 1.16's ``vllm_importance_sampling_mode`` values, same maths):

- ``token_truncate``: ``w_t = clip(rho_t, C_min, C_max)`` (truncated IS: Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"; TRL's ``token_truncate``);
- ``token_mask``: ``w_t = rho_t`` inside ``[C_min, C_max]``, else 0 (the token leaves the policy term; with both
  bounds this is ICEPOP, "IcePop", the Ring-1T report, 2025);
- ``sequence_truncate``: one ratio per response, ``rho = prod_t rho_t = exp(sum_t (log pi_old - log pi_b))`` (the
  product over the response's tokens, not GSPO's geometric mean: TRL sums the per-token log-ratios), clipped to
  ``[C_min, C_max]`` and put on every token of the response;
- ``sequence_mask``: the same ``rho``, the whole response masked (weight 0) when it is outside ``[C_min, C_max]``
  (TRL 1.16's default, with ``C_max = 3``, no ``C_min``).

Truncate modes clip to the bounds; mask modes zero what falls outside them. A missing bound is no bound.

With the weights on the clipped surrogate of ``policy_gradient.clipped_policy_loss`` (whose ratio is
``pi_theta / pi_old``) the loss is the decoupled PPO objective of AReaL (Fu et al. 2025, "AReaL: a large-scale
asynchronous reinforcement learning system for language reasoning", arXiv:2505.24298): the clip taken around the
proximal policy ``pi_old``, the importance weight against the behaviour policy (``decoupled_policy_loss``). AReaL's
own weight is ``token_mask`` with ``C_max`` = its ``behav_imp_weight_cap`` and no ``C_min``.

Pure tensor functions; per-token tensors are (N, R) with a 0/1 ``mask`` of response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from aitraining_pl.losses.policy_gradient import clipped_policy_loss


def off_policy_log_ratio(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old - log pi_b`` per response token, 0 outside ``mask`` and where the sampler gave no log-prob (NaN:
    the ratio is then 1, no correction, as TRL); (N, R), detached."""
    diff = (logprobs.detach() - sampling_logprobs.detach()) * mask.to(logprobs.dtype)
    return torch.nan_to_num(diff, nan=0.0)


def _log_bounds(clip_min: float | None, clip_max: float | None) -> tuple[float, float]:
    """The bounds in log space (a missing bound, or ``C_min = 0``, is infinite)."""
    low = math.log(clip_min) if clip_min else -math.inf
    return low, math.inf if clip_max is None else math.log(clip_max)


def truncated(log_ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """``clip(exp(log_ratio), C_min, C_max)``, clipped in log space (no overflow for a long response)."""
    low, high = _log_bounds(clip_min, clip_max)
    return torch.exp(log_ratio.clamp(low, high))


def masked(log_ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """``exp(log_ratio)`` where it is inside ``[C_min, C_max]``, else 0."""
    return torch.exp(log_ratio.masked_fill(outside(log_ratio, clip_min, clip_max), -math.inf))


def outside(log_ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """Where ``exp(log_ratio)`` is outside ``[C_min, C_max]`` (bool, same shape)."""
    low, high = _log_bounds(clip_min, clip_max)
    return (log_ratio < low) | (log_ratio > high)


def sequence_log_ratio_sum(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t log_ratio_t`` over each response's tokens (the log of the product of the token ratios), on every
    token of the row; (N, R)."""
    return (log_ratio * mask.to(log_ratio.dtype)).sum(1, keepdim=True).expand_as(log_ratio)


def token_truncate(log_ratio: torch.Tensor, mask: torch.Tensor, clip_min: float | None, clip_max: float | None):
    """Truncated IS per token (Yao et al. 2025): ``clip(rho_t, C_min, C_max)``."""
    return truncated(log_ratio, clip_min, clip_max)


def token_mask(log_ratio: torch.Tensor, mask: torch.Tensor, clip_min: float | None, clip_max: float | None):
    """Masked IS per token (ICEPOP with both bounds; AReaL with ``C_max`` only): ``rho_t``, 0 outside the bounds."""
    return masked(log_ratio, clip_min, clip_max)


def sequence_truncate(log_ratio: torch.Tensor, mask: torch.Tensor, clip_min: float | None, clip_max: float | None):
    """Truncated IS per response: ``clip(prod_t rho_t, C_min, C_max)`` on each of its tokens."""
    return truncated(sequence_log_ratio_sum(log_ratio, mask), clip_min, clip_max)


def sequence_mask(log_ratio: torch.Tensor, mask: torch.Tensor, clip_min: float | None, clip_max: float | None):
    """Masked IS per response (TRL 1.16's default): ``prod_t rho_t`` on each token, 0 for the whole response outside
    the bounds."""
    return masked(sequence_log_ratio_sum(log_ratio, mask), clip_min, clip_max)


#: The ``importance_sampling_mode`` values that correct (``policy_options.ImportanceSamplingMode`` adds ``none``, no
#: correction, and ``auto``, resolved per device by ``PolicyLossConfig.off_policy_mode``).
IMPORTANCE_SAMPLING_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "token_truncate": token_truncate,
    "token_mask": token_mask,
    "sequence_truncate": sequence_truncate,
    "sequence_mask": sequence_mask,
}


def off_policy_weights(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str | None = None,
    clip_min: float | None = None,
    clip_max: float | None = None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The sampler/trainer mismatch of one rollout and its importance weights.

    Args:
        logprobs: (N, R) the trainer's log-probs of the sampled tokens at rollout time (``pi_old``).
        sampling_logprobs: (N, R) the behaviour policy's (the sampler's) log-probs of the same tokens.
        mask: (N, R) response tokens.
        mode: a key of ``IMPORTANCE_SAMPLING_MODES``; ``None`` or ``"none"`` computes only the statistics.
        clip_min, clip_max: ``C_min``, ``C_max`` (``None``: no bound).

    Returns:
        ``(weights, stats)``: (N, R) detached weights (1 outside the mask; ``None`` without a mode) and the stats
        over response tokens: ``logp_gap/mean``, ``logp_gap/max`` (``|log pi_b - log pi_old|``), ``mismatch_kl``
        (mean k3 estimate of KL(pi_b || pi_old) per token, Schulman 2020: ``rho - 1 - log rho`` on tokens sampled from
        ``pi_b``); with a mode ``is_weight/mean``, ``/min``, ``/max`` (over response tokens) and, for mask modes,
        ``masked_tokens`` (share of response tokens whose weight is 0) and ``masked_sequences`` (share of responses
        with a masked token), for truncate modes ``truncated_tokens`` and ``truncated_sequences`` (a weight that
        hit a bound).
    """
    boolean = mask.bool()
    mask = mask.to(logprobs.dtype)
    n = mask.sum().clamp_min(1.0)
    log_ratio = off_policy_log_ratio(logprobs, sampling_logprobs, mask)
    gap = log_ratio.abs()
    stats = {
        "logp_gap/mean": gap.sum() / n,
        "logp_gap/max": gap.max() if gap.numel() else gap.sum(),
        "mismatch_kl": ((torch.expm1(log_ratio) - log_ratio) * mask).sum() / n,
    }
    if mode is None or mode == "none":
        return None, stats
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"unknown importance_sampling_mode {mode!r}; known: none, {', '.join(IMPORTANCE_SAMPLING_MODES)}"
        )
    raw = IMPORTANCE_SAMPLING_MODES[mode](log_ratio, mask, clip_min, clip_max)
    weights = torch.where(boolean, raw, torch.ones_like(raw))
    level = sequence_log_ratio_sum(log_ratio, mask) if mode.startswith("sequence") else log_ratio
    hit = outside(level, clip_min, clip_max) & boolean  # masked (weight 0) or truncated (weight at a bound)
    name, rows = "masked" if mode.endswith("_mask") else "truncated", boolean.any(1)
    inside = weights[boolean] if boolean.any() else torch.ones(1, dtype=weights.dtype, device=weights.device)
    stats.update(
        {
            "is_weight/mean": (weights * mask).sum() / n,
            "is_weight/min": inside.min(),
            "is_weight/max": inside.max(),
            f"{name}_tokens": hit.sum() / n,
            f"{name}_sequences": (hit.any(1) & rows).sum() / rows.sum().clamp_min(1),
        }
    )
    return weights, stats


def decoupled_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mask",
    clip_min: float | None = None,
    clip_max: float | None = None,
    **loss_options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO objective (Fu et al. 2025, arXiv:2505.24298), per token
    ``l_t = w_t * max(-A u_t, -A clip(u_t, 1 - eps, 1 + eps_high))`` with ``u_t = pi_theta / pi_prox`` (the clip
    around the proximal policy) and ``w_t`` the detached importance weight of ``pi_prox / pi_behav`` under ``mode``
    (``off_policy_weights``; AReaL's is ``token_mask`` with ``clip_max`` its ``behav_imp_weight_cap``).

    This is what the online modules compute when a rollout carries the sampler's log-probs: ``old_logprobs`` (the
    trainer's at rollout time) are ``pi_prox``, ``sampling_logprobs`` are ``pi_behav``. The coupled alternative (the
    clip around ``pi_behav`` itself, no separate weight: TRL 1.16's ``AsyncGRPOTrainer``) is not this function.

    Args:
        logprobs: (N, R) ``log pi_theta`` (with gradient). proximal_logprobs, behaviour_logprobs, advantages, mask:
            (N, R). mode, clip_min, clip_max: as ``off_policy_weights``.
        loss_options: passed to ``clipped_policy_loss`` (``epsilon``, ``epsilon_high``, ``aggregation``, ...).

    Returns:
        ``(loss, stats)``: the ``clipped_policy_loss`` statistics and ``off_policy_weights``'.
    """
    weights, stats = off_policy_weights(proximal_logprobs, behaviour_logprobs, mask, mode, clip_min, clip_max)
    loss, loss_stats = clipped_policy_loss(
        logprobs, proximal_logprobs, advantages, mask, token_weights=weights, **loss_options
    )
    return loss, {**loss_stats, **stats}


def truncated_importance_weights(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, cap: float | None = None
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Deprecated (kept for one release): ``off_policy_weights(..., "token_truncate", clip_max=cap)``, or only the
    statistics without ``cap``."""
    return off_policy_weights(logprobs, sampling_logprobs, mask, "token_truncate" if cap else None, None, cap)
