"""Token-id helpers shared by the data modules and the reward models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def with_bos(ids: Sequence[int], tokenizer: Any) -> list[int]:
    """``ids`` with the tokenizer's BOS token in front, unless it has none or ``ids`` already starts with it (a
    chat template that writes BOS itself), so every sequence starts the way the model was pretrained."""
    ids = list(ids)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids
