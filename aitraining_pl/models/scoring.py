"""Sequence scoring: log-probs of given tokens under a causal LM, padded or packed (``models.packing``).

Used by every module that scores sequences (DPO, PPO and the online-RL family).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from aitraining_pl.losses import SequenceLogps, selective_log_softmax
from aitraining_pl.models.packing import AttentionPlan, packed_attention, supports_packing


class PackedBatch(NamedTuple):
    """The real tokens of a preference batch in one row (see ``pack_batch``)."""

    input_ids: torch.Tensor  #: (1, N)
    position_ids: torch.Tensor  #: (1, N): positions within each sequence
    plan: AttentionPlan  #: which tokens attend to which
    sources: torch.Tensor  #: (M,) packed position whose output predicts a scored token
    targets: torch.Tensor  #: (M,) the scored token
    sequences: torch.Tensor  #: (M,) row of the batch the scored token belongs to (chosen 0..B-1, rejected B..2B-1)


def prompt_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(2B,) leading non-completion tokens of each row."""
    return (batch["completion_mask"].cumsum(1) == 0).sum(1)


def pack_batch(batch: dict[str, torch.Tensor], share_prompt: bool = False) -> PackedBatch:
    """Pack the real tokens of a preference batch (2B right-padded rows, chosen first) into one row.

    Each row becomes one causal attention block. With ``share_prompt`` each pair is ``prompt, chosen,
    rejected`` with the prompt held once: the rejected completion attends to the prompt and to itself, its
    positions continue from the prompt, and its first token is predicted from the last prompt position, so
    every token sees exactly what it sees in its own padded row.
    """
    ids = batch["input_ids"]
    lengths, prompts = batch["attention_mask"].sum(1).tolist(), prompt_lengths(batch).tolist()
    b = len(lengths) // 2
    rows, cols, positions, blocks, sources, targets, sequences = [], [], [], [], [], [], []
    start = 0

    def take(row: int, lo: int, hi: int, first_position: int) -> None:
        rows.extend([row] * (hi - lo))
        cols.extend(range(lo, hi))
        positions.extend(range(first_position, first_position + hi - lo))

    def score(sequence: int, first: int, last: int, first_source: int) -> None:  # packed targets [first, last)
        sources.extend([first_source] + list(range(first, last - 1)))
        targets.extend(range(first, last))
        sequences.extend([sequence] * (last - first))

    for i in range(b if share_prompt else 2 * b):
        p = prompts[i]
        if share_prompt:
            c, r = lengths[i] - p, lengths[b + i] - p
            take(i, 0, p + c, 0)
            take(b + i, p, p + r, p)
            blocks += [(((start, start + p + c),), p + c), (((start, start + p), (start + p + c, start + p + c + r)), r)]
            score(i, start + p, start + p + c, start + p - 1)
            score(b + i, start + p + c, start + p + c + r, start + p - 1)
            start += p + c + r
        else:
            n = lengths[i]
            take(i, 0, n, 0)
            blocks.append((((start, start + n),), n))
            score(i, start + p, start + n, start + p - 1)
            start += n
    device = ids.device
    packed = ids[torch.tensor(rows, device=device), torch.tensor(cols, device=device)].unsqueeze(0)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedBatch(packed, as_tensor(positions).unsqueeze(0), AttentionPlan(blocks), as_tensor(sources),
                       packed[0, as_tensor(targets)], as_tensor(sequences))


def can_pack(batch: dict[str, torch.Tensor], share_prompt: bool = False) -> bool:
    """Whether every row has a non-empty prompt (its first completion token is predicted from it) and, for
    ``share_prompt``, each pair's chosen and rejected rows the same prompt."""
    prompt = prompt_lengths(batch)
    if not bool((prompt > 0).all()):
        return False
    if not share_prompt:
        return True
    chosen, rejected = prompt.chunk(2)
    width = int(chosen.max())
    ids, keep = batch["input_ids"][:, :width].chunk(2), torch.arange(width, device=prompt.device) < chosen.view(-1, 1)
    return torch.equal(chosen, rejected) and torch.equal(ids[0] * keep, ids[1] * keep)


def _decoder_and_head(model: nn.Module):
    """(decoder, lm head, config) of a transformers causal LM (through a ``peft`` wrapper), or Nones."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    config = getattr(lm, "config", None)
    if getattr(config, "logit_scale", None) is not None:  # heads with extra scaling: use the model's forward
        decoder = head = None
    return decoder, head, config


def _head_logps(head: nn.Module, config: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return selective_log_softmax(logits.float(), targets)


def completion_logps(model: nn.Module, batch: dict[str, torch.Tensor], padding_free: bool = False,
                     share_prompt: bool = False) -> SequenceLogps:
    """Summed completion-token log-probs of every row of ``batch`` (chosen rows, then rejected rows).

    The language-model head runs only on positions whose next token is a completion token, so the
    (rows, length, vocabulary) logits tensor is never built. ``padding_free`` runs the real tokens packed in
    one row (``pack_batch``, ``models.packing``): no work on padding. ``share_prompt`` (packed too) holds each
    pair's prompt once. Both fall back to padded rows for a model that cannot run packed
    (``supports_packing``) or a batch with an empty prompt; a model without a separable decoder and head
    runs its full forward.

    Args:
        model: a transformers causal LM (optionally wrapped by ``peft``).
        batch: ``input_ids``, ``attention_mask``, ``completion_mask``, each (2B, L).
        padding_free: pack the rows' real tokens into one row.
        share_prompt: pack each pair as one sequence holding its prompt once.

    Returns:
        ``SequenceLogps(logps (2B,), lengths (2B,))``.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    scored = batch["completion_mask"][:, 1:].bool()  # position t scores token t + 1
    lengths = scored.sum(-1).float()
    decoder, head, config = _decoder_and_head(model)
    packed = None
    if decoder is not None and (padding_free or share_prompt) and supports_packing(config):
        if share_prompt and can_pack(batch, share_prompt=True):
            packed = pack_batch(batch, share_prompt=True)
        elif can_pack(batch):  # prompts differ within a pair: still packed, one block per row
            packed = pack_batch(batch)
    if decoder is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        token, rows = selective_log_softmax(logits[scored], input_ids[:, 1:][scored]), torch.nonzero(scored, as_tuple=True)[0]
    elif packed is not None:
        with packed_attention(config, packed.plan):
            hidden = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                             packed_plan=packed.plan).last_hidden_state
        token, rows = _head_logps(head, config, hidden[0, packed.sources], packed.targets), packed.sequences
    else:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        token = _head_logps(head, config, hidden[:, :-1][scored], input_ids[:, 1:][scored])
        rows = torch.nonzero(scored, as_tuple=True)[0]
    logps = torch.zeros(input_ids.shape[0], dtype=token.dtype, device=token.device).index_add(0, rows, token)
    return SequenceLogps(logps, lengths.to(token.dtype))
