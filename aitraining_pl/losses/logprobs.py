"""Token log-probabilities, entropies and masked statistics.

Pure tensor functions: no Lightning or transformers imports. Shapes use B (batch), T (sequence length)
and V (vocabulary size).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the tokens ``index`` under ``logits``, without a full log-softmax copy.

    ``log p(index) = logits[index] - logsumexp(logits)``. For float32/float64 the logsumexp is one
    reduction over V, so no (B, T, V) log-softmax tensor is kept. Half-precision logits are processed one
    row at a time in float32 (a bf16 logsumexp loses too much precision for PPO ratios).

    Args:
        logits: (..., V) unnormalised scores.
        index: (...) token ids, same leading shape as ``logits``.

    Returns:
        (...) log-probabilities, float32 (or float64 for float64 logits).
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [
        torch.gather(F.log_softmax(row.float(), dim=-1), -1, idx.unsqueeze(-1)).squeeze(-1)
        for row, idx in zip(logits, index)
    ]
    return torch.stack(rows)


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities of ``input_ids[:, 1:]``; logits at position t score token t + 1.

    Args:
        logits: (B, T, V). input_ids: (B, T).

    Returns:
        (B, T - 1) where entry t is ``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])``.
    """
    return selective_log_softmax(logits[:, :-1], input_ids[:, 1:])


class SequenceLogps(NamedTuple):
    logps: torch.Tensor  #: (B,) sum of completion-token log-probs
    lengths: torch.Tensor  #: (B,) number of completion tokens scored


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> SequenceLogps:
    """Per-sequence sum of completion-token log-probabilities and the completion token counts.

    Logits at position t score token t + 1, so the first token of a sequence is never scored.

    Args:
        logits: (B, T, V).
        input_ids: (B, T).
        completion_mask: (B, T), 1 on completion tokens (aligned with ``input_ids``), 0 on prompt and pad.

    Returns:
        ``SequenceLogps(logps (B,), lengths (B,))``.
    """
    per_token = token_logps(logits, input_ids)
    mask = completion_mask[:, 1:].to(per_token.dtype)
    return SequenceLogps((per_token * mask).sum(-1), mask.sum(-1))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``: ``logsumexp(z) - sum softmax(z) z``.

    Args:
        logits: (..., V).

    Returns:
        (...) entropy in nats, float32.
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids counting only real tokens (``cumsum - 1``: 0 at each row's first real token and on
    the padding before it), so a left-padded row gets the same positions, hence the same hidden states, as its
    right-padded twin; ``generate`` counts positions of left-padded prompts the same way. The one position
    helper of the package (the rollout, the RL modules and the reward trunks use it)."""
    return (attention_mask.to(torch.long).cumsum(-1) - 1).clamp_min(0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (over everything, or along ``dim``).

    Args:
        x: any shape. mask: broadcastable to ``x``; 0/1 or bool.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``x`` (Bessel-corrected by default, as in TRL and trlx)."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"masked_var needs at least 2 unmasked entries for an unbiased estimate, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the masked entries of ``x`` to unit variance (and zero mean if ``shift_mean``).

    With ``shift_mean=False`` the mean is added back, so only the scale changes (used for rewards in
    Ziegler et al. 2019). Entries outside the mask are returned as 0.
    """
    mask = mask.to(x.dtype)
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[targets - predictions] / Var[targets]`` over the mask (1 is a perfect value function)."""
    var_t = masked_var(targets, mask, unbiased=False)
    return 1.0 - masked_var(targets - predictions, mask, unbiased=False) / var_t.clamp_min(1e-8)
