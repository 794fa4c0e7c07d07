"""Preference losses: the DPO family, ORPO and Bradley-Terry reward-model loss.

Pure tensor functions. Every ``*_logps`` argument is a (B,) tensor of summed completion-token
log-probabilities, one entry per preference pair.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F


class DPOOutput(NamedTuple):
    losses: torch.Tensor  #: (B,) per-pair loss
    chosen_rewards: torch.Tensor  #: (B,) implicit reward of the chosen completion, detached
    rejected_rewards: torch.Tensor  #: (B,) implicit reward of the rejected completion, detached


class _PairTerms(NamedTuple):
    """What a DPO-family loss sees: the (policy - reference) log-ratio of each completion."""

    chosen: torch.Tensor  # (B,)
    rejected: torch.Tensor  # (B,)
    beta: float
    label_smoothing: float
    gamma: float

    @property
    def margin(self) -> torch.Tensor:
        """h = (log pi/ref)(chosen) - (log pi/ref)(rejected)."""
        return self.chosen - self.rejected


def _sigmoid(t: _PairTerms) -> torch.Tensor:
    """DPO (Rafailov et al. 2023); label smoothing eps gives conservative DPO (Mitchell 2023):
    ``-(1 - eps) log s(beta h) - eps log s(-beta h)``."""
    z = t.beta * t.margin
    return -(1 - t.label_smoothing) * F.logsigmoid(z) - t.label_smoothing * F.logsigmoid(-z)


def _robust(t: _PairTerms) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024), unbiased under label-flip rate eps:
    ``(-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)``."""
    if t.label_smoothing >= 0.5:
        raise ValueError("robust DPO needs label_smoothing < 0.5")
    z = t.beta * t.margin
    return (-(1 - t.label_smoothing) * F.logsigmoid(z) + t.label_smoothing * F.logsigmoid(-z)) / (
        1 - 2 * t.label_smoothing
    )


def _hinge(t: _PairTerms) -> torch.Tensor:
    """SLiC-HF calibration loss (Zhao et al. 2023): ``max(0, 1 - beta h)``."""
    return torch.relu(1 - t.beta * t.margin)


def _ipo(t: _PairTerms) -> torch.Tensor:
    """IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2`` with h built from per-token averaged log-ratios."""
    return (t.margin - 1 / (2 * t.beta)) ** 2


def _simpo(t: _PairTerms) -> torch.Tensor:
    """SimPO (Meng et al. 2024): ``-log s(beta (avg logp_c - avg logp_r) - gamma)``, reference-free,
    label smoothing as in ``sigmoid``."""
    z = t.beta * t.margin - t.gamma
    return -(1 - t.label_smoothing) * F.logsigmoid(z) - t.label_smoothing * F.logsigmoid(-z)


#: The ``loss_type`` values, as a type (``--help`` lists them); equal to the keys of ``DPO_LOSSES`` (tested).
DPOLossType = Literal["sigmoid", "robust", "hinge", "ipo", "simpo"]

DPO_LOSSES: dict[str, Callable[[_PairTerms], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "robust": _robust,
    "hinge": _hinge,
    "ipo": _ipo,
    "simpo": _simpo,
}
#: Loss types whose log-probabilities are averaged per completion token instead of summed.
LENGTH_NORMALISED = frozenset({"ipo", "simpo"})
#: Loss types that never use a reference model.
REFERENCE_FREE = frozenset({"simpo"})


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    gamma: float = 0.5,
) -> DPOOutput:
    """Direct preference losses on summed completion log-probs, per pair.

    ``loss_type`` picks a function from ``DPO_LOSSES``: ``sigmoid`` (DPO, Rafailov et al. 2023; with
    ``label_smoothing`` > 0 conservative DPO, Mitchell 2023), ``robust`` (Chowdhury et al. 2024), ``hinge``
    (SLiC, Zhao et al. 2023), ``ipo`` (Azar et al. 2023) and ``simpo`` (Meng et al. 2024, with margin
    ``gamma``). ``ipo`` and ``simpo`` divide every log-prob by its completion length, so they need
    ``chosen_lengths`` and ``rejected_lengths``. ``simpo`` and ``reference_free=True`` take the reference
    log-probs as 0 (the reference arguments may then be ``None``).

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: (B,).
        chosen_lengths, rejected_lengths: (B,) completion token counts.

    Returns:
        ``DPOOutput(losses, chosen_rewards, rejected_rewards)``, each (B,). Rewards are
        ``beta * (log pi - log ref)`` of each completion (length-averaged for ``ipo``/``simpo``), detached.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; known: {', '.join(sorted(DPO_LOSSES))}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    no_ref = reference_free or loss_type in REFERENCE_FREE
    if not no_ref and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError("reference log-probs are required unless reference_free=True or loss_type='simpo'")
    chosen, rejected = policy_chosen_logps, policy_rejected_logps
    if not no_ref:
        chosen, rejected = chosen - ref_chosen_logps, rejected - ref_rejected_logps
    if loss_type in LENGTH_NORMALISED:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type {loss_type!r} averages per token: pass chosen_lengths and rejected_lengths")
        chosen, rejected = chosen / chosen_lengths.clamp_min(1), rejected / rejected_lengths.clamp_min(1)
    terms = _PairTerms(chosen, rejected, beta, label_smoothing, gamma)
    losses = DPO_LOSSES[loss_type](terms)
    return DPOOutput(losses, (beta * chosen).detach(), (beta * rejected).detach())


class ORPOOutput(NamedTuple):
    losses: torch.Tensor  #: (B,) NLL of the chosen completion minus beta * log s(log odds ratio)
    log_odds_ratio: torch.Tensor  #: (B,) log s(log odds ratio), detached
    log_odds: torch.Tensor  #: (B,) log odds(chosen) - log odds(rejected), detached


def orpo_loss(
    chosen_logps_avg: torch.Tensor, rejected_logps_avg: torch.Tensor, chosen_nll: torch.Tensor, beta: float
) -> ORPOOutput:
    """ORPO (Hong et al. 2024): ``L = NLL(chosen) - beta * log s(log odds(y_w) - log odds(y_l))``.

    ``odds(y) = p / (1 - p)`` with ``p = exp(avg token log-prob)``, so
    ``log odds = logp - log(1 - exp(logp))``.

    Args:
        chosen_logps_avg, rejected_logps_avg: (B,) per-token averaged log-probs (< 0).
        chosen_nll: (B,) or scalar NLL of the chosen completion.
    """
    log_odds = (chosen_logps_avg - rejected_logps_avg) - (
        torch.log1p(-torch.exp(chosen_logps_avg)) - torch.log1p(-torch.exp(rejected_logps_avg))
    )
    ratio = F.logsigmoid(log_odds)
    return ORPOOutput(chosen_nll - beta * ratio, ratio.detach(), log_odds.detach())


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Bradley-Terry reward-model loss (Ouyang et al. 2022), mean over pairs.

    ``-log s(r_c - r_r - m)`` with an optional per-pair margin m (Llama 2, Touvron et al. 2023) plus
    ``center_coef * mean((r_c + r_r)^2)``, which keeps rewards centred at 0 (Eisenstein et al. 2023).

    Args:
        chosen_scores, rejected_scores: (B,) scalar rewards. margin: (B,) or None.

    Returns:
        scalar loss.
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen_scores + rejected_scores) ** 2).mean()
    return loss
