"""Token-id helpers shared by the data modules, the rollouts and the reward models."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch

#: ``adds_bos`` per tokenizer object (asked once: it encodes a probe text twice)
_ADDS_BOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` itself puts its BOS token first when it encodes with special tokens, as TRL's
    tokenization (``tokenizer(text)``) then has it: Llama 3, Gemma and Mistral do; SmolLM2 declares
    ``<|im_start|>`` as its BOS token but never adds it; Qwen2.5 has none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        return _ADDS_BOS[tokenizer]
    except (KeyError, TypeError):
        pass
    first = list(tokenizer("x")["input_ids"])[:1]
    answer = first == [bos] and list(tokenizer("x", add_special_tokens=False)["input_ids"])[:1] != [bos]
    with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced is asked each time
        _ADDS_BOS[tokenizer] = answer
    return answer


def with_bos(ids: Sequence[int], tokenizer: Any) -> list[int]:
    """``ids`` with the tokenizer's BOS token in front when the tokenizer adds it itself (``adds_bos``) and ``ids``
    do not already start with it (a chat template that writes BOS itself), so every sequence starts as the model's
    own tokenizer starts it."""
    ids = list(ids)
    if adds_bos(tokenizer) and (not ids or ids[0] != tokenizer.bos_token_id):
        ids.insert(0, tokenizer.bos_token_id)
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
