"""Padding-free attention for transformers decoders: many sequences packed into one row of tokens.

A batch of padded rows wastes work on padding in every linear layer and in attention. Packing puts the real
tokens of all sequences end to end in one row (``position_ids`` restart per sequence, so rotary embeddings
see each sequence's own positions) and runs attention block by block, so no token attends across sequences
and none is computed for padding. A block may also take its keys from several ranges of the row, which lets a
preference pair hold its prompt once for both completions.

This is the variable-length ("unpadded") attention of FlashAttention (Dao 2023) written with one SDPA call
per block, so it runs on any device SDPA runs on, CPU included. The attention is registered with
transformers' ``AttentionInterface`` and switched on only inside ``packed_attention(config, plan)``; the
model's own implementation is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_ATTENTION = "aitraining_pl_packed"

#: ((start, end) key ranges of the packed row, number of queries): the queries are the last ``queries``
#: tokens of the concatenated key ranges, attending causally (aligned at the bottom right)
Block = tuple[tuple[tuple[int, int], ...], int]


@dataclass
class AttentionPlan:
    """Attention blocks of a packed row, in token order: the blocks' queries, concatenated, are the whole row.

    Args:
        blocks: one ``(key ranges, queries)`` entry per block.
        calls: attention layers that used the plan in the last forward (a model that does not route
            attention through ``AttentionInterface`` leaves it at 0, see ``packed_attention``).
    """

    blocks: list[Block]
    calls: int = field(default=0, compare=False)
    _pieces: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def pieces(self) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
        """The row cut at every range boundary: (piece sizes, per block (key pieces, query pieces)).

        Blocks gather whole pieces of one ``split`` of the row, whose backward is one concatenation, rather
        than slicing the row per block, whose backward writes a row-sized gradient per slice.
        """
        if self._pieces is None:
            cuts = sorted(
                {0}
                | {x for ranges, q in self.blocks for a, b in ranges for x in (a, b)}
                | {ranges[-1][1] - q for ranges, q in self.blocks}
            )
            at = {cut: i for i, cut in enumerate(cuts)}
            blocks = [
                (
                    [i for a, b in ranges for i in range(at[a], at[b])],
                    list(range(at[ranges[-1][1] - q], at[ranges[-1][1]])),
                )
                for ranges, q in self.blocks
            ]
            self._pieces = ([b - a for a, b in zip(cuts, cuts[1:])], blocks)
        return self._pieces


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def _plan_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    sizes, blocks = plan.pieces()
    qs, ks, vs = (t.split(sizes, dim=2) for t in (query, key, value))
    out = []
    for key_pieces, query_pieces in blocks:
        q, k, v = (
            _cat([qs[i] for i in query_pieces]),
            _cat([ks[i] for i in key_pieces]),
            _cat([vs[i] for i in key_pieces]),
        )
        queries, keys = q.shape[2], k.shape[2]
        if queries == keys:
            out.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True))
        else:  # causal, aligned at the bottom right: query j sees keys up to keys - queries + j
            mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling))
    return torch.cat(out, dim=2)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_plan: AttentionPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``(1, heads, tokens, dim)`` inputs, ``(1, tokens, heads, dim)`` output.

    Without a ``packed_plan`` (e.g. a forward outside ``completion_logps``) it is transformers' SDPA.
    """
    if packed_plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    packed_plan.calls += 1
    out = _plan_attention(query, key, value, packed_plan, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


def supports_packing(config: Any) -> bool:
    """Whether a decoder with this config can run packed: its attention is SDPA or eager (plain softmax
    attention over every earlier token), with no sliding window and no logit soft-capping."""
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "_attn_implementation", None) not in (
        "sdpa",
        "eager",
    ):
        return False
    if getattr(config, "attn_logit_softcapping", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


#: configs switched to packed attention by the ``packed_attention`` blocks being run (innermost last)
_ACTIVE: list[Any] = []


@contextmanager
def _switched(configs: list[Any]) -> Iterator[None]:
    previous = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        for config, implementation in zip(configs, previous):
            config._attn_implementation = implementation


def checkpoint_contexts() -> tuple[Any, Any]:
    """``context_fn`` of ``torch.utils.checkpoint``: the recomputation in backward (outside the
    ``packed_attention`` block) runs with the attention implementation the checkpointed forward ran with."""
    return nullcontext(), _switched(list(_ACTIVE))


@contextmanager
def packed_attention(config: Any, plan: AttentionPlan) -> Iterator[AttentionPlan]:
    """Switch a model (through its ``config``) to packed attention for the forwards inside the block; pass
    ``packed_plan=plan`` to the decoder. Raises after the block when no attention layer used the plan (a model
    whose attention bypasses ``AttentionInterface`` would otherwise attend across sequences silently)."""
    plan.calls = 0
    _ACTIVE.append(config)
    try:
        with _switched([config]):
            yield plan
    finally:
        _ACTIVE.pop()
    if plan.calls == 0:
        raise RuntimeError(
            f"{type(config).__name__}: the model's attention did not use the packed plan; "
            "run it padded (padding_free=False)"
        )
