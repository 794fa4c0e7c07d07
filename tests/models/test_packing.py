"""Padding-free packed attention (``aitraining_pl.models.packing``): exactness, the guard, which models run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from architectures import build_sharpened
from conftest import TINY_LLAMA
from test_architectures import _rows, own_logps, preference_batch
from transformers import AutoConfig

from aitraining_pl.models import build_causal_lm, packing
from aitraining_pl.models.packing import AttentionPlan, packed_attention, supports_packing
from aitraining_pl.models.scoring import completion_logps, pack_batch
from aitraining_pl.models.training import disable_dropout


def _config(**overrides):
    spec = {**TINY_LLAMA, **overrides}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def test_plan_pieces_cut_the_row_at_every_boundary():
    # one sequence of 3 tokens; a pair: prompt [3, 5), chosen [5, 7), rejected [7, 10)
    plan = AttentionPlan([(((0, 3),), 3), (((3, 7),), 4), (((3, 5), (7, 10)), 3)])
    sizes, blocks = plan.pieces()
    assert sizes == [3, 2, 2, 3]
    assert blocks == [([0], [0]), ([1, 2], [1, 2]), ([1, 3], [3])]


def test_plan_runs_cut_long_blocks_into_query_runs():
    # a sequence of 5 tokens and a pair (prompt [5, 7), chosen [7, 9), rejected [9, 13)), runs of about 2 queries
    plan = AttentionPlan([(((0, 5),), 5), (((5, 9),), 4), (((5, 7), (9, 13)), 4)])
    assert plan.runs(2) == [[(0, 2, 2), (2, 5, 5)], [(0, 2, 2), (2, 4, 4)], [(0, 2, 4), (2, 4, 6)]]
    assert plan.runs(None) == [[(0, 5, 5)], [(0, 4, 4)], [(0, 4, 6)]]
    masks = plan.masks(2, torch.device("cpu"), torch.float32)
    assert masks[0][0] is None and masks[1][1].shape == (2, 4) and masks[2][0].shape == (2, 4)
    assert (masks[2][0] == 0).tolist() == [[True, True, True, False], [True, True, True, True]]


def _attention(plan, chunk, monkeypatch, seed=0):
    """Output and input gradients of the plan's attention on random (1, 2, N, 8) inputs, in runs of ``chunk``."""
    monkeypatch.setattr(packing, "CPU_QUERY_CHUNK", chunk)
    n = sum(q for _, q in plan.blocks)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g).requires_grad_() for _ in range(3))
    out, _ = packing.packed_attention_forward(None, q, k, v, None, packed_plan=plan)
    return (out, *torch.autograd.grad((out * torch.randn(out.shape, generator=g)).sum(), (q, k, v)))


def test_query_runs_give_the_same_attention_and_gradients(monkeypatch):
    plan = AttentionPlan([(((0, 9),), 9), (((9, 20),), 11), (((9, 14), (20, 27)), 7)])
    whole = _attention(plan, None, monkeypatch)
    for chunk in (1, 2, 3):
        for got, want in zip(_attention(plan, chunk, monkeypatch), whole):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma", "phi3"])
def test_query_runs_keep_dpo_logps_equal_the_models_own_forward(model_type, monkeypatch):
    """The architecture matrix's DPO check (``test_architectures``) with runs of 2 queries, so that every block of
    its short rows is cut."""
    monkeypatch.setattr(packing, "CPU_QUERY_CHUNK", 2)
    model = build_sharpened(model_type)
    disable_dropout(model)
    model.train()
    rows = _rows(0)
    got = completion_logps(model, preference_batch(rows), padding_free=True, share_prompt=True).logps
    sequences = [(p, c) for p, c, _ in rows] + [(p, r) for p, _, r in rows]
    want = torch.stack([own_logps(model, p, c).sum() for p, c in sequences])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_half_precision_cuda_batches_run_one_variable_length_call(monkeypatch):
    """The CUDA path (FlashAttention's varlen kernel; stubbed here by SDPA per sequence, bottom-right causal as
    FlashAttention's mask is) gives what the per-block calls give, in one call with the plan's keys end to end."""
    plan = AttentionPlan([(((0, 9),), 9), (((9, 20),), 11), (((9, 14), (20, 27)), 7)])
    seen = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        seen.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, window_size))
        out = []
        for (a, b), (c, d) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[a:b], k[c:d], v[c:d]))
            mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(int(d - c) - int(b - a))
            out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setattr(packing, "_varlen_attn", lambda: varlen_attn)
    monkeypatch.setattr(packing, "_use_varlen", lambda query, dropout: True)
    got = _attention(plan, None, monkeypatch)
    monkeypatch.setattr(packing, "_use_varlen", lambda query, dropout: False)
    for a, b in zip(got, _attention(plan, None, monkeypatch)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert seen == [([0, 9, 20, 27], [0, 9, 20, 32], 11, 12, (-1, 0))]


def test_packed_attention_equals_separate_sequences():
    # two sequences packed in one row give the outputs each gives alone, for eager and SDPA models
    torch.manual_seed(0)
    a, b = torch.randint(3, 300, (1, 7)), torch.randint(3, 300, (1, 4))
    for implementation in ("eager", "sdpa"):
        model = build_causal_lm(TINY_LLAMA, seed=0)
        model.config._attn_implementation = implementation
        alone = [model.model(input_ids=x).last_hidden_state for x in (a, b)]
        plan = AttentionPlan([(((0, 7),), 7), (((7, 11),), 4)])
        with packed_attention(model.config, plan):
            packed = model.model(
                input_ids=torch.cat([a, b], 1),
                position_ids=torch.tensor([list(range(7)) + list(range(4))]),
                packed_plan=plan,
            ).last_hidden_state
        assert plan.calls == TINY_LLAMA["num_hidden_layers"]
        assert model.config._attn_implementation == implementation
        torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)


def test_packed_attention_raises_when_no_layer_used_the_plan():
    config = _config()
    with pytest.raises(RuntimeError, match="did not use the packed plan"):
        with packed_attention(config, AttentionPlan([(((0, 1),), 1)])):
            pass  # a model whose attention bypasses AttentionInterface would leave the plan unused
    assert config._attn_implementation != "aitraining_pl_packed"


def test_supports_packing_only_for_full_softmax_attention():
    llama = _config()
    llama._attn_implementation = "sdpa"
    assert supports_packing(llama)
    eager_window = _config(model_type="mistral", sliding_window=16)
    eager_window._attn_implementation = "eager"
    assert not supports_packing(eager_window)
    softcap = AutoConfig.for_model(
        "gemma2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=384,
    )
    softcap._attn_implementation = "sdpa"
    assert not supports_packing(softcap)
    flash = _config()
    flash._attn_implementation = "flash_attention_2"
    assert not supports_packing(flash)


def test_unsupported_models_run_padded_with_the_same_logps():
    model = build_causal_lm({**TINY_LLAMA, "model_type": "mistral", "sliding_window": 4}, seed=0)
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 1, 0, 0], [5, 6, 8, 9, 10, 1]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]),
    }
    padded = completion_logps(model, batch)
    packed = completion_logps(model, batch, padding_free=True, share_prompt=True)  # falls back: sliding window
    torch.testing.assert_close(packed.logps, padded.logps)


def test_pairs_with_different_prompts_run_packed_one_block_per_row(monkeypatch):
    import aitraining_pl.models.scoring as scoring

    calls = []
    model = build_causal_lm(TINY_LLAMA, seed=0)
    assert scoring.scoring_path(model).name == "packed"  # the one-time probe (it packs its own batch) runs first
    monkeypatch.setattr(
        scoring,
        "pack_batch",
        lambda batch, share_prompt=False: calls.append(share_prompt) or pack_batch(batch, share_prompt),
    )
    batch = {  # the pair's chosen row has prompt [5, 6], its rejected row [5, 7]: the prompt cannot be shared
        "input_ids": torch.tensor([[5, 6, 7, 1, 0], [5, 7, 8, 9, 1]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]),
    }
    padded = completion_logps(model, batch)
    torch.testing.assert_close(
        completion_logps(model, batch, share_prompt=True).logps, padded.logps, rtol=1e-5, atol=1e-5
    )
    assert calls == [False]
