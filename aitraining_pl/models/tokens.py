"""Token-id helpers shared by the data modules, the rollouts and the reward models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch


def with_bos(ids: Sequence[int], tokenizer: Any) -> list[int]:
    """``ids`` with the tokenizer's BOS token in front, unless it has none or ``ids`` already starts with it (a
    chat template that writes BOS itself), so every sequence starts the way the model was pretrained."""
    ids = list(ids)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def padded(
    rows: Sequence[Sequence[int] | Sequence[float] | torch.Tensor],
    pad: int | float,
    side: Literal["right", "left"] = "right",
    *,
    width: int = 0,
    dtype: torch.dtype = torch.long,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length rows stacked into one (N, W) tensor, ``pad`` on ``side``, and their (N, W) long mask (1 on
    each row's own values). W: the longest row, at least ``width``.

    Args:
        rows: token ids (or, with ``dtype``, other values) per row: lists or 1-D tensors.
        pad: the value of the padding.
        side: ``right`` (the values first, as responses are) or ``left`` (the values last, as prompts are).
        width: the least width (e.g. 1, so that a batch of empty rows still has a column).
        dtype: of the values (the mask is long).
        device: of both tensors (default: the first tensor row's, else the CPU).
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    if device is None:
        device = next((row.device for row in rows if isinstance(row, torch.Tensor)), None)
    longest = max([width, *(len(row) for row in rows)])
    values = torch.full((len(rows), longest), pad, dtype=dtype, device=device)
    mask = torch.zeros((len(rows), longest), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        if len(row):
            columns = slice(0, len(row)) if side == "right" else slice(longest - len(row), longest)
            values[i, columns] = torch.as_tensor(row, dtype=dtype, device=device)
            mask[i, columns] = 1
    return values, mask
