"""Prompts that begin alike are held once in a packed row (``models.shared_prefix``): which row holds each prompt
token, and rollout rows scored packed as a prefix tree equal the padded rows (log-probs, entropies, gradients)."""

from __future__ import annotations

import torch
from conftest import TINY_LLAMA

import aitraining_pl.models.rollout_scoring as rollout_scoring
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.packing import pack_rows
from aitraining_pl.models.rollout_scoring import packed_tokens, response_logps, will_pack
from aitraining_pl.models.shared_prefix import prefix_holders

P = 4
#: prompts [a b c d], [a b e f], [. a b c] (left-padded), [a b c d] (row 0's); responses of 6, 4, 3 and 2 tokens
A, B, C, D, E, F = 11, 12, 13, 14, 15, 16
PROMPTS = [[A, B, C, D], [A, B, E, F], [0, A, B, C], [A, B, C, D]]
RESPONSES = [6, 4, 3, 2]


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(20, 384, (4, 10), generator=torch.Generator().manual_seed(0))
    ids[:, :P] = torch.tensor(PROMPTS)
    attention = torch.zeros(4, 10, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        attention[row, : P + response] = 1
        attention[row, : prompt.count(0)] = 0
    return ids, attention


def test_each_prompt_token_is_held_by_the_first_row_with_the_same_beginning():
    """Row 1 shares ``a b`` with row 0, the left-padded row 2 its whole prompt ``a b c`` (counted from its first
    real token), row 3 all of row 0's; a row's own tokens are a suffix of its prompt."""
    ids, attention = _rows()
    assert prefix_holders(ids, attention.bool(), P).tolist() == [
        [0, 0, 0, 0],
        [0, 0, 1, 1],
        [-1, 0, 0, 0],
        [0, 0, 0, 0],
    ]
    distinct = torch.tensor([[5, 6], [7, 8]])
    assert prefix_holders(distinct, distinct > 0, 2).tolist() == [[0, 0], [1, 1]]
    assert prefix_holders(distinct, distinct > 0, 0).shape == (2, 0)


def test_rows_packed_as_a_prefix_tree_equal_the_padded_rows(monkeypatch):
    """6 prompt tokens held (row 0's four, row 1's ``e f``) and 15 response tokens: 21 packed tokens of 40 (the
    rows' prompts each held once would be 4 + 4 + 3 + 15 = 26); row 2's first response token is predicted from row
    0's ``c``. Log-probs, entropies and gradients equal the padded rows'."""
    ids, attention = _rows()
    assert packed_tokens(ids, attention, P) == 21
    model = build_causal_lm(TINY_LLAMA, seed=0)
    assert will_pack(model, attention, P, input_ids=ids)
    lengths = []
    monkeypatch.setattr(
        rollout_scoring,
        "pack_rows",
        lambda *a, **k: (lambda packed: lengths.append(packed.input_ids.shape[1]) or packed)(pack_rows(*a, **k)),
    )
    weights = torch.linspace(-1, 1, 4 * (10 - P)).view(4, -1)
    scores = {}
    for padding_free in (True, False):
        out = response_logps(model, ids, attention, P, 0.7, padding_free=padding_free, with_entropy=True)
        model.zero_grad()
        ((out.logprobs * weights).sum() + out.entropy.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        scores[padding_free] = (out.logprobs.detach(), out.entropy.detach(), grads)
    assert lengths == [21]
    torch.testing.assert_close(scores[True][0], scores[False][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores[True][1], scores[False][1], rtol=0, atol=1e-5)
    for got, want in zip(scores[True][2], scores[False][2]):  # sums in another order: ulps of the largest entry
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 + 1e-6 * want.abs().max().item())
