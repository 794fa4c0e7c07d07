"""Preference losses: the DPO family, ORPO and Bradley-Terry reward-model loss.

Pure tensor functions. Every ``*_logps`` argument is a (B,) tensor of summed completion-token
log-probabilities, one entry per preference pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F


class DPOOutput(NamedTuple):
    losses: torch.Tensor  #: (B,) per-pair loss
    chosen_rewards: torch.Tensor  #: (B,) implicit reward of the chosen completion, detached
    rejected_rewards: torch.Tensor  #: (B,) implicit reward of the rejected completion, detached


class _PairTerms(NamedTuple):
    """What a DPO-family loss sees: the (policy - reference) log-ratio of each completion (the policy log-prob
    alone where the loss is reference-free; per token for ``LENGTH_NORMALISED`` losses)."""

    chosen: torch.Tensor  # (B,)
    rejected: torch.Tensor  # (B,)
    beta: float
    label_smoothing: float
    gamma: float
    ref_margin: torch.Tensor  # (B,) reference log p(chosen) - log p(rejected); 0 when reference-free
    chosen_nll: torch.Tensor | None  # scalar: mean negative log-likelihood per chosen token over the batch
    tau: float  # DiscoPOP's temperature

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


def _exo_pair(t: _PairTerms) -> torch.Tensor:
    """EXO-pref (Ji et al. 2024, eq. 16), K = 2: ``KL(q || p)`` between the policy's two-way softmax
    ``q = (s(beta h), s(-beta h))`` and the smoothed label ``p = (1 - eps, eps)``; needs ``label_smoothing`` > 0
    (the paper uses 1e-3)."""
    if t.label_smoothing <= 0:
        raise ValueError("exo_pair needs label_smoothing > 0 (the paper's epsilon, e.g. 1e-3)")
    z = t.beta * t.margin
    eps = t.label_smoothing
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(eps)
    )


def _nca_pair(t: _PairTerms) -> torch.Tensor:
    """NCA (Chen et al. 2024, "Noise Contrastive Alignment"), pairwise:
    ``-log s(r_w) - 0.5 log s(-r_w) - 0.5 log s(-r_l)`` with ``r = beta * log(pi/ref)``."""
    rw, rl = t.beta * t.chosen, t.beta * t.rejected
    return -F.logsigmoid(rw) - 0.5 * F.logsigmoid(-rw) - 0.5 * F.logsigmoid(-rl)


def _bco_pair(t: _PairTerms) -> torch.Tensor:
    """BCO on pairs (Jung et al. 2024, "Binary Classifier Optimization"), as TRL's ``bco_pair`` (no reward shift):
    ``-log s(r_w) - log s(-r_l)`` with ``r = beta * log(pi/ref)``."""
    return -F.logsigmoid(t.beta * t.chosen) - F.logsigmoid(-t.beta * t.rejected)


def _sppo_hard(t: _PairTerms) -> torch.Tensor:
    """SPPO (Wu et al. 2024, eq. 4.7) with hard win probabilities (1 for the chosen, 0 for the rejected):
    ``(log(pi/ref)_w - 1 / (2 beta))^2 + (log(pi/ref)_l + 1 / (2 beta))^2``."""
    return (t.chosen - 0.5 / t.beta) ** 2 + (t.rejected + 0.5 / t.beta) ** 2


def _smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _aot(t: _PairTerms) -> torch.Tensor:
    """AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment via Optimal Transport"): the batch's
    policy margins ``log pi(w) - log pi(l)`` and reference margins, each sorted, matched in order, through the
    (label-smoothed) sigmoid loss; each entry is a quantile of the batch, not a pair."""
    policy, _ = torch.sort(t.margin + t.ref_margin)
    reference, _ = torch.sort(t.ref_margin)
    return _smoothed_sigmoid(t.beta * (policy - reference), t.label_smoothing)


def _aot_unpaired(t: _PairTerms) -> torch.Tensor:
    """AOT, unpaired (Melnyk et al. 2024): the batch's chosen and rejected log-ratios, each sorted, matched in
    order, through the (label-smoothed) sigmoid loss (TRL 1.16's ``aot_unpaired``; ``aot_pair`` in TRL < 1.0)."""
    chosen, _ = torch.sort(t.chosen)
    rejected, _ = torch.sort(t.rejected)
    return _smoothed_sigmoid(t.beta * (chosen - rejected), t.label_smoothing)


def _apo_zero(t: _PairTerms) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, eq. 7; chosen outputs better than the model's):
    ``1 - s(beta log(pi/ref)_w) + s(beta log(pi/ref)_l)``."""
    return 1 - torch.sigmoid(t.beta * t.chosen) + torch.sigmoid(t.beta * t.rejected)


def _apo_down(t: _PairTerms) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, eq. 8; chosen outputs worse than the model's):
    ``s(beta log(pi/ref)_w) + 1 - s(beta h)``."""
    return torch.sigmoid(t.beta * t.chosen) + 1 - torch.sigmoid(t.beta * t.margin)


def _discopop(t: _PairTerms) -> torch.Tensor:
    """DiscoPOP's log-ratio modulated loss (Chan et al. 2024, eq. 5): with ``z = beta h`` and
    ``m = s(z / tau)``, ``(1 - m) (-log s(z)) + m exp(-z)``."""
    z = t.beta * t.margin
    mix = torch.sigmoid(z / t.tau)
    return (1 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)


def _sigmoid_norm(t: _PairTerms) -> torch.Tensor:
    """DPO's sigmoid loss on per-token averaged log-ratios (TRL's ``sigmoid_norm``): ``-log s(beta h_avg)``."""
    return -F.logsigmoid(t.beta * t.margin)


def _sft(t: _PairTerms) -> torch.Tensor:
    """The chosen completions' mean token NLL over the batch, the same for every pair; beside ``sigmoid`` with
    ``loss_weights`` it is RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization")."""
    if t.chosen_nll is None:
        raise ValueError("loss_type 'sft' needs chosen_lengths (its NLL is per token)")
    return t.chosen_nll.expand_as(t.chosen)


#: The ``loss_type`` values, as a type (``--help`` lists them); equal to the keys of ``DPO_LOSSES`` (tested).
DPOLossType = Literal[
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "simpo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "aot_pair",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
]

DPO_LOSSES: dict[str, Callable[[_PairTerms], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "robust": _robust,
    "hinge": _hinge,
    "ipo": _ipo,
    "simpo": _simpo,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "aot_pair": _aot_unpaired,  # TRL's name before 1.0
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sigmoid_norm": _sigmoid_norm,
    "sft": _sft,
}
#: Loss types whose log-probs are averaged per completion token instead of summed.
LENGTH_NORMALISED = frozenset({"ipo", "simpo", "sigmoid_norm"})
#: Loss types that never use a reference model.
REFERENCE_FREE = frozenset({"simpo", "sft"})


def loss_types(loss_type: str | Sequence[str]) -> list[str]:
    """``loss_type`` as a list (one name or several), each checked against ``DPO_LOSSES``."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    unknown = [t for t in types if t not in DPO_LOSSES]
    if unknown or not types:
        raise ValueError(f"unknown DPO loss_type {unknown or types!r}; known: {', '.join(sorted(DPO_LOSSES))}")
    return types


def needs_reference(loss_type: str | Sequence[str], reference_free: bool = False) -> bool:
    """Whether any of the loss types reads reference log-probs."""
    return not reference_free and any(t not in REFERENCE_FREE for t in loss_types(loss_type))


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    gamma: float = 0.5,
    discopop_tau: float = 0.05,
) -> DPOOutput:
    """Direct preference losses on summed completion log-probs, per pair.

    ``loss_type`` picks a function from ``DPO_LOSSES`` (each cites its paper), or several, whose per-pair losses
    are added with ``loss_weights`` (default 1 each; TRL's multi-loss, e.g. ``["sigmoid", "sft"]`` is RPO).
    ``sigmoid`` with ``label_smoothing`` > 0 is conservative DPO (Mitchell 2023). ``ipo``, ``simpo`` and
    ``sigmoid_norm`` divide every log-prob by its completion length, so they need ``chosen_lengths`` and
    ``rejected_lengths`` (``sft`` needs ``chosen_lengths``). ``simpo``, ``sft`` and ``reference_free=True`` take
    the reference log-probs as 0 (the reference arguments may then be ``None``).

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: (B,).
        chosen_lengths, rejected_lengths: (B,) completion token counts.

    Returns:
        ``DPOOutput(losses, chosen_rewards, rejected_rewards)``, each (B,). Rewards are
        ``beta * (log pi - log ref)`` of each completion under the first loss type other than ``sft``
        (length-averaged for ``ipo``/``simpo``/``sigmoid_norm``), detached.
    """
    types = loss_types(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(types)} loss types")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if needs_reference(types, reference_free) and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError("reference log-probs are required unless reference_free=True or loss_type='simpo'")
    nll = None
    if chosen_lengths is not None:
        nll = -policy_chosen_logps.sum() / chosen_lengths.sum().clamp_min(1)

    def terms(kind: str) -> _PairTerms:
        chosen, rejected = policy_chosen_logps, policy_rejected_logps
        ref_margin = torch.zeros_like(chosen)
        if not (reference_free or kind in REFERENCE_FREE):
            chosen, rejected = chosen - ref_chosen_logps, rejected - ref_rejected_logps
            ref_margin = ref_chosen_logps - ref_rejected_logps
        if kind in LENGTH_NORMALISED:
            if chosen_lengths is None or rejected_lengths is None:
                raise ValueError(f"loss_type {kind!r} averages per token: pass chosen_lengths and rejected_lengths")
            chosen, rejected = chosen / chosen_lengths.clamp_min(1), rejected / rejected_lengths.clamp_min(1)
        return _PairTerms(chosen, rejected, beta, label_smoothing, gamma, ref_margin, nll, discopop_tau)

    losses = sum(w * DPO_LOSSES[kind](terms(kind)) for kind, w in zip(types, weights))
    first = terms(next((kind for kind in types if kind != "sft"), types[0]))  # the rewards' loss type
    return DPOOutput(losses, (beta * first.chosen).detach(), (beta * first.rejected).detach())


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
    # log(1 - exp(x)) as log(-expm1(x)): exact also for x near 0 (a completion the model is sure of)
    log_odds = (chosen_logps_avg - rejected_logps_avg) - (
        torch.log(-torch.expm1(chosen_logps_avg)) - torch.log(-torch.expm1(rejected_logps_avg))
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
