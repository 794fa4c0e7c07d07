"""Reward-model maths beyond Bradley-Terry: pooling a sequence into one vector, and the masked
multi-objective regression loss.

Pure tensor functions (no Lightning, no transformers).
"""

from __future__ import annotations

from typing import Literal

import torch

POOLING_STRATEGIES = ("last", "mean", "cls")
#: The ``pooling_strategy`` values, as a type; equal to ``POOLING_STRATEGIES`` (tested).
PoolingStrategy = Literal["last", "mean", "cls"]


def pool_hidden_states(hidden: torch.Tensor, attention_mask: torch.Tensor, strategy: str = "last") -> torch.Tensor:
    """One vector per sequence, correct for left and right padding (and any mask with holes).

    ``last``: the hidden state of the last token whose mask is 1 (the one a causal trunk has read everything
    up to, as in InstructGPT's reward model, Ouyang et al. 2022); ``cls``: the first token whose mask is 1
    (BERT's [CLS], Devlin et al. 2019); ``mean``: the mean over tokens whose mask is 1.
    A row with no real token pools the last position (``last``), the first (``cls``) or zeros (``mean``).

    Args:
        hidden: (B, T, H). attention_mask: (B, T), 1 for real tokens.

    Returns:
        (B, H).
    """
    if strategy not in POOLING_STRATEGIES:
        raise ValueError(f"unknown pooling_strategy {strategy!r}; known: {', '.join(POOLING_STRATEGIES)}")
    mask = attention_mask.to(torch.long)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if strategy == "mean":
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)
    if strategy == "cls":
        return hidden[rows, mask.argmax(-1)]  # argmax returns the first maximal index
    last = hidden.shape[1] - 1 - mask.flip(-1).argmax(-1)
    return hidden[rows, last]


def known_objectives(targets: torch.Tensor, objective_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, n) bool: where a multi-objective target is known (``objective_mask`` (B, n) or (n,) truthy; without a
    mask, where the target is finite)."""
    if objective_mask is None:
        return torch.isfinite(targets)
    return objective_mask.to(torch.bool).expand_as(targets)


def masked_objective_mse(
    predictions: torch.Tensor, targets: torch.Tensor, objective_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error per objective over the rows where that objective has a target (multi-objective
    reward models, e.g. ArmoRM, Wang et al. 2024).

    A masked entry contributes nothing: neither to the loss nor to any gradient, even when its target is
    NaN. ``per_objective[j]`` is the mean over rows that have objective j (0 when none has); ``total`` is the
    mean of ``per_objective`` over objectives present in the batch.

    Args:
        predictions, targets: (B, n). objective_mask: (B, n) or (n,), truthy where the target is known;
            ``None`` means every finite target is known.

    Returns:
        ``(total, per_objective)``: a scalar and an (n,) tensor.
    """
    if predictions.shape != targets.shape:
        raise ValueError(f"predictions {tuple(predictions.shape)} and targets {tuple(targets.shape)} differ in shape")
    mask = known_objectives(targets, objective_mask)
    safe_targets = torch.where(mask, targets, torch.zeros_like(targets))
    errors = torch.where(mask, (predictions - safe_targets) ** 2, torch.zeros_like(predictions))
    counts = mask.sum(0)
    per_objective = errors.sum(0) / counts.clamp_min(1)
    present = counts > 0
    total = per_objective[present].mean() if bool(present.any()) else errors.sum() * 0.0
    return total, per_objective
