"""KTO: Kahneman-Tversky optimisation on unpaired completions labelled desirable or undesirable.

Pure tensor functions (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization").
Every ``*_logps`` argument is a (B,) tensor of summed completion-token log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class KTOOutput(NamedTuple):
    losses: torch.Tensor  #: (B,) weighted per-completion loss
    rewards: torch.Tensor  #: (B,) implicit reward ``beta * log(pi / ref)``, detached


def kto_reference_point(
    policy_kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """KTO's reference point z0: ``max(0, mean(log pi(y'|x) - log ref(y'|x)))`` over mismatched pairs (x, y')
    (a completion of another prompt of the batch), a biased but cheap estimate of ``KL(pi || ref)``; detached,
    as in the paper (no gradient flows through z0).

    Args:
        policy_kl_logps, ref_kl_logps: (B,) log-probs of the mismatched completions.
        reduce: applied to the batch mean before the clamp, e.g. the average across data-parallel ranks.

    Returns:
        scalar.
    """
    mean = (policy_kl_logps - ref_kl_logps).detach().mean()
    return (reduce(mean) if reduce is not None else mean).clamp_min(0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOOutput:
    """KTO's loss (Ethayarajh et al. 2024, eq. 8) per completion, with ``r = log pi(y|x) - log ref(y|x)``:

    - desirable: ``lambda_D * (1 - s(beta (r - z0)))``;
    - undesirable: ``lambda_U * (1 - s(beta (z0 - r)))``,

    where ``lambda_D`` / ``lambda_U`` are ``desirable_weight`` / ``undesirable_weight`` (the paper keeps
    ``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3]) and z0 is ``kto_reference_point``.

    Args:
        policy_logps, ref_logps: (B,) summed completion log-probs.
        desirable: (B,) bool, the label of each completion.
        reference_point: z0 (scalar, no gradient).

    Returns:
        ``KTOOutput(losses (B,), rewards (B,))``; the training loss is ``losses.mean()``.
    """
    ratio = policy_logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - reference_point)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (reference_point - ratio)))
    return KTOOutput(torch.where(desirable.bool(), good, bad), (beta * ratio).detach())
