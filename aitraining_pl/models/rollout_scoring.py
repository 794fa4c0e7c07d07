"""Per-token log-probs (and entropies) of sampled responses, padded or packed, for online RL.

A rollout row is a left-padded prompt followed by a right-padded response; its real tokens are one
contiguous run. ``response_logps`` runs the decoder either on the padded rows or on the real tokens packed
end to end in one row (``models.packing``: one causal block per rollout, positions restarting at 0 as
``generate`` counted them), and the language-model head only on positions that predict a response token.
Both give the same log-probs (tested); the packed path does no work on padding.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from aitraining_pl.losses import entropy_from_logits, selective_log_softmax
from aitraining_pl.models.packing import AttentionPlan, packed_attention
from aitraining_pl.models.scoring import _decoder_and_head, head_logits, scoring_path


class PackedRollout(NamedTuple):
    input_ids: torch.Tensor  #: (1, T) real tokens of all rows
    position_ids: torch.Tensor  #: (1, T)
    plan: AttentionPlan  #: one causal block per row
    sources: torch.Tensor  #: (M,) packed position predicting each response token


def pack_rollout(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> PackedRollout:
    """Pack the real tokens of rollout rows ``(N, P + R)`` (left-padded prompt, right-padded response)
    into one row; ``sources`` follow the row-major order of ``attention_mask[:, P:]``'s ones."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    prompt = mask[:, :prompt_length].sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lengths.tolist()])
    blocks = [(((s, s + n),), n) for s, n in zip(starts.tolist(), lengths.tolist())]
    # response token j of row i (j < its length) is predicted by packed position start + prompt + j - 1
    response = mask[:, prompt_length:]
    rows, cols = torch.nonzero(response, as_tuple=True)
    sources = starts[rows] + prompt[rows] + cols - 1
    return PackedRollout(input_ids[mask].unsqueeze(0), positions.unsqueeze(0), AttentionPlan(blocks), sources)


class ResponseScores(NamedTuple):
    logprobs: torch.Tensor  #: (N, R), 0 outside the response mask
    entropy: Optional[torch.Tensor]  #: (N, R) or None
    hidden: Optional[torch.Tensor]  #: (M, H) hidden states predicting the response tokens (row-major), or None


def _logits(head: nn.Module, config, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    return head_logits(head, config, hidden).float() / temperature


def response_logps(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
    temperature: float = 1.0, padding_free: bool = True, with_entropy: bool = False,
) -> ResponseScores:
    """Log-probs ``log pi(y_t | x, y_<t) `` (temperature-scaled logits) of the response tokens.

    Args:
        model: a transformers causal LM (optionally wrapped by ``peft``).
        input_ids, attention_mask: (N, P + R) rollout rows; the response mask is ``attention_mask[:, P:]``.
        prompt_length: P.
        padding_free: pack the real tokens in one row where that is exact for the model
            (``models.scoring.scoring_path``) and every row has a non-empty prompt; else padded rows (head only
            on the response positions where that is exact, else the model's own forward).
        with_entropy: also return the per-token entropy of the policy.
    """
    response = attention_mask[:, prompt_length:].bool()
    targets = input_ids[:, prompt_length:][response]
    decoder, head, config = _decoder_and_head(model)
    path = scoring_path(model)
    packable = padding_free and path.packed and bool((attention_mask[:, :prompt_length].sum(1) > 0).all())
    if decoder is None or not (path.head or packable):
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
        logits = logits[:, prompt_length - 1 : -1][response].float() / temperature
        hidden = None
    else:
        if packable:
            packed = pack_rollout(input_ids, attention_mask, prompt_length)
            with packed_attention(config, packed.plan):
                out = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                              packed_plan=packed.plan).last_hidden_state
            hidden = out[0, packed.sources]
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          use_cache=False).last_hidden_state
            hidden = out[:, prompt_length - 1 : -1][response]
        logits = _logits(head, config, hidden, temperature)
    logprobs = torch.zeros(response.shape, dtype=torch.float32, device=input_ids.device)
    logprobs = logprobs.masked_scatter(response, selective_log_softmax(logits, targets))
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logprobs).masked_scatter(response, entropy_from_logits(logits))
    return ResponseScores(logprobs, entropy, hidden)
