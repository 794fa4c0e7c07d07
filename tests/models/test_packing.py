"""Padding-free packed attention (``aitraining_pl.models.packing``): exactness, the guard, which models run it."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA
from transformers import AutoConfig

from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.packing import AttentionPlan, packed_attention, supports_packing
from aitraining_pl.models.scoring import completion_logps, pack_batch


def _config(**overrides):
    spec = {**TINY_LLAMA, **overrides}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def test_plan_pieces_cut_the_row_at_every_boundary():
    # one sequence of 3 tokens; a pair: prompt [3, 5), chosen [5, 7), rejected [7, 10)
    plan = AttentionPlan([(((0, 3),), 3), (((3, 7),), 4), (((3, 5), (7, 10)), 3)])
    sizes, blocks = plan.pieces()
    assert sizes == [3, 2, 2, 3]
    assert blocks == [([0], [0]), ([1, 2], [1, 2]), ([1, 3], [3])]


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
