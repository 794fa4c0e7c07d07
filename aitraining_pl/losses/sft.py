"""The supervised fine-tuning (SFT) objective: maximum likelihood of the target tokens.

The first stage of the RLHF pipeline (Ouyang et al. 2022, "Training language models to follow instructions
with human feedback", section 3.5; Stiennon et al. 2020): minimise the mean negative log-likelihood of
the demonstration tokens, here the scored tokens (completions, assistant turns, or all tokens).
"""

from __future__ import annotations

import torch


def sft_loss(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token negative log-likelihood ``-(1/M) sum_i log p(y_i | y_<i)`` over the M tokens where ``mask``
    is 1 (every token weighs the same, however long its sequence, as transformers' causal-LM loss).

    Args:
        token_logps: (B, T) log-probs of the tokens.
        mask: (B, T) 1 on the scored tokens, 0 elsewhere.

    Returns:
        () the loss; 0 (with a gradient path) when no token is scored.
    """
    mask = mask.to(token_logps.dtype)
    return -(token_logps * mask).sum() / mask.sum().clamp(min=1.0)
