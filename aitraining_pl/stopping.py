"""When a response stops: stop strings and stop sequences of token ids, looked for in the response tokens only,
by one rule shared by ``generate`` (``ResponseStoppingCriteria``) and the response mask (``StopRule.ends``)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import StoppingCriteria


class StopRule:
    """Stop strings and stop sequences of token ids, checked on the response tokens only.

    A response prefix ``ids`` stops when its decoding (special tokens decoded as their text) contains one of
    ``stop_strings``, or when it ends with one of ``stop_sequences``. ``generate`` checks every prefix as it
    grows (``ResponseStoppingCriteria``) and ``ends`` finds the first stopping prefix afterwards, so both agree.

    Args:
        tokenizer: decodes responses for ``stop_strings`` (may be None when there are none).
        stop_strings: texts that end a response.
        stop_sequences: token-id sequences that end a response.
        skip_special_tokens: look for stop strings in the text without special tokens (default: special tokens
            are decoded as their text, as transformers' own stop strings see them).
    """

    def __init__(
        self, tokenizer=None, stop_strings: Sequence[str] | None = None,
        stop_sequences: Sequence[Sequence[int]] | None = None, skip_special_tokens: bool = False,
    ):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.stop_strings = [s for s in (stop_strings or []) if s]
        self.stop_sequences = [[int(t) for t in s] for s in (stop_sequences or []) if len(s)]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def __bool__(self) -> bool:
        return bool(self.stop_strings or self.stop_sequences)

    def stops(self, ids: list[int]) -> bool:
        """Whether the response prefix ``ids`` has reached a stop."""
        if any(len(ids) >= len(s) and ids[-len(s):] == s for s in self.stop_sequences):
            return True
        return bool(self.stop_strings) and self._contains_string(ids)

    def _contains_string(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return any(s in text for s in self.stop_strings)

    def ends(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(N,) index of the token at which a response first stops; -1 where it never does."""
        ends = torch.full((response_ids.shape[0],), -1, dtype=torch.long, device=response_ids.device)
        if not self:
            return ends
        for row, ids in enumerate(response_ids.tolist()):
            seq_hit = any(_find(ids, s) >= 0 for s in self.stop_sequences)
            if not (seq_hit or (self.stop_strings and self._contains_string(ids))):
                continue  # no prefix can stop if the whole response does not
            ends[row] = next(t for t in range(len(ids)) if self.stops(ids[: t + 1]))
        return ends


def _find(ids: list[int], seq: list[int]) -> int:
    """Start of the first occurrence of ``seq`` in ``ids``; -1 where none."""
    return next((i for i in range(len(ids) - len(seq) + 1) if ids[i : i + len(seq)] == seq), -1)


class ResponseStoppingCriteria(StoppingCriteria):
    """``generate``'s view of a ``StopRule``: rows whose response (tokens after the first ``prompt_length``)
    stops; rows that already hold an end token are finished and not decoded again."""

    def __init__(self, rule: StopRule, prompt_length: int, end_ids: Sequence[int]):
        self.rule, self.prompt_length, self.end_ids = rule, prompt_length, list(end_ids)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        response = input_ids[:, self.prompt_length :]
        done = torch.zeros(response.shape[0], dtype=torch.bool, device=input_ids.device)
        ends = torch.tensor(self.end_ids, dtype=response.dtype, device=response.device)
        finished = torch.isin(response, ends).any(1).tolist()
        for row, ids in enumerate(response.tolist()):
            done[row] = not finished[row] and self.rule.stops(ids)
        return done
