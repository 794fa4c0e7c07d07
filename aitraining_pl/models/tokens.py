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


#: ``assistant_turn_markup`` per tokenizer object (asked once: it renders three probe conversations)
_TURN_MARKUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROBE_USER, _PROBE_ASSISTANT = "\x00user probe\x00", "\x00assistant probe\x00"


def assistant_turn_markup(tokenizer: Any) -> tuple[str, str, str] | None:
    """What the tokenizer's own chat template writes around an assistant message that answers a user: ``(opening,
    lead, end)``, the text from the end of the user's message to the end of the generation prompt, the text between
    that and the message, and the text after it. ChatML (Qwen2.5, SmolLM2): ``("<|im_end|>\\n<|im_start|>assistant
    \\n", "", "<|im_end|>\\n")``; Mistral: ``("[/INST]", " ", "</s>")``. ``None`` without a chat template or where the
    template does not render an assistant message after its generation prompt (nothing is then assumed)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return _TURN_MARKUP[tokenizer]
    except (KeyError, TypeError):
        pass
    user = [{"role": "user", "content": _PROBE_USER}]
    try:
        opened = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        answer = [{"role": "assistant", "content": _PROBE_ASSISTANT}]
        full = tokenizer.apply_chat_template(user + answer, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no markup is assumed
        full = opened = ""
    markup = None
    if _PROBE_USER in opened and full.startswith(opened) and _PROBE_ASSISTANT in full[len(opened) :]:
        lead, _, end = full[len(opened) :].partition(_PROBE_ASSISTANT)
        markup = (opened[opened.index(_PROBE_USER) + len(_PROBE_USER) :], lead, end)
    with contextlib.suppress(TypeError):
        _TURN_MARKUP[tokenizer] = markup
    return markup


def closed_turn(tokenizer: Any, prompt: str, response: str, separator: str = "") -> str:
    """``prompt + separator + response`` as the text a reward model scores. A prompt that opened an assistant turn
    with the tokenizer's own chat template (it ends as the template's generation prompt ends) gets the response as the
    template renders an assistant message (its lead, unless the response starts with it, and its end of turn), so the
    text is the template's rendering of the conversation, as a conversational preference pair is laid out for
    training (``datamodules.preference.encode_pair``)."""
    markup = assistant_turn_markup(tokenizer) if not separator else None
    if markup is not None and markup[0] and markup[2] and prompt.endswith(markup[0]):
        opening, lead, end = markup
        return prompt + ("" if response.startswith(lead) else lead) + response + end
    return prompt + separator + response


def ends_turn(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether token ``ids`` end with the end of an assistant turn of the tokenizer's own chat template."""
    markup = assistant_turn_markup(tokenizer)
    if markup is None or not markup[2]:
        return False
    end = list(tokenizer(markup[2], add_special_tokens=False)["input_ids"])
    return bool(end) and list(ids[-len(end) :]) == end


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
