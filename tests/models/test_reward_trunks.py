"""Reward trunks on an architecture matrix: a padded batch scores exactly as each sequence alone.

For every trunk, ``RewardModel.score`` on a left- and a right-padded batch equals the head applied to the
trunk's own forward (no position ids, no padding) on each sequence, for every pooling strategy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aitraining_pl.losses.reward import pool_hidden_states
from aitraining_pl.models.reward import RewardModel, RewardModelConfig
from aitraining_pl.models.trunk_positions import trunk_hidden

COMMON = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=128,
    max_position_embeddings=64,
)  # fmt: skip
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {
    "bert": {},
    "roberta": {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},  # positions start at padding_idx + 1
    "xlm-roberta": {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
    "deberta-v2": {},
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64},
    "electra": {},
    "modernbert": {**SPECIAL, "cls_token_id": 1, "sep_token_id": 2, "global_attn_every_n_layers": 1},
    "llama": {"num_key_value_heads": 2, **SPECIAL},
    "qwen2": {"num_key_value_heads": 2, **SPECIAL},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, **SPECIAL},
}
POOLINGS = ("last", "mean", "cls")


def _trunk(arch: str) -> nn.Module:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(arch, **{**COMMON, **ARCHS[arch]})
    torch.manual_seed(0)
    trunk = AutoModel.from_config(config).eval()
    with torch.no_grad():  # sharpen: larger embeddings make a wrong position visible in every score
        trunk.get_input_embeddings().weight.mul_(20.0)
    return trunk


def _sequences(pad_id: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=generator) for n in (7, 4, 1, 5)]


def _batch(seqs: list[torch.Tensor], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids, mask = torch.full((len(seqs), width), pad_id), torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, cols], mask[row, cols] = seq, 1
    return ids, mask


def _own_scores(model: RewardModel, seqs: list[torch.Tensor], pooling: str) -> torch.Tensor:
    """The head on the trunk's own forward of each unpadded sequence (nothing but ids and an all-ones mask)."""
    scores = []
    for seq in seqs:
        hidden = model.trunk(input_ids=seq[None], attention_mask=torch.ones_like(seq)[None]).last_hidden_state
        pooled = pool_hidden_states(hidden, torch.ones_like(seq)[None], pooling).float()
        scores.append(model.head(pooled)[0, 0] / model.config.temperature)
    return torch.stack(scores)


def matrix_row(arch: str) -> dict:
    """Max |score - own score| per padding side (over all poolings), and the chosen position mode."""
    trunk = _trunk(arch)
    pad_id = trunk.config.pad_token_id if trunk.config.pad_token_id is not None else 0
    model = RewardModel(RewardModelConfig(dropout_prob=0.0, temperature=0.7), trunk=trunk).eval()
    seqs = _sequences(pad_id)
    row = {"arch": arch, "mode": model.position_mode}
    with torch.no_grad():
        for side in ("left", "right"):
            ids, mask = _batch(seqs, pad_id, side)
            worst, scale = 0.0, 0.0
            for pooling in POOLINGS:
                model.config.pooling_strategy = pooling
                own = _own_scores(model, seqs, pooling)
                worst = max(worst, float((model.score(ids, mask) - own).abs().max()))
                scale = max(scale, float(own.abs().max()))
            row[side], row["scale"] = worst, scale
    return row


@pytest.mark.parametrize("arch", list(ARCHS))
def test_padded_scores_equal_the_trunks_own_forward(arch):
    row = matrix_row(arch)
    print(row)
    tol = 1e-4 * max(1.0, row["scale"])
    assert row["left"] <= tol and row["right"] <= tol, row


@pytest.mark.parametrize(("arch", "wrong_mode"), [("roberta", "mask"), ("bert", "none")])
def test_the_matrix_detects_wrong_positions(arch, wrong_mode):
    """Sanity of the matrix: forcing the other position handling gives a clearly different left-padded score
    (RoBERTa's positions start at padding_idx + 1; BERT's count from the tensor's first column)."""
    trunk = _trunk(arch)
    model = RewardModel(RewardModelConfig(dropout_prob=0.0), trunk=trunk).eval()
    assert model.position_mode != wrong_mode
    model.position_mode = wrong_mode
    seqs = _sequences(trunk.config.pad_token_id)
    ids, mask = _batch(seqs, trunk.config.pad_token_id, "left")
    with torch.no_grad():
        assert float((model.score(ids, mask) - _own_scores(model, seqs, "last")).abs().max()) > 1e-3


class _NoPositionsTrunk(nn.Module):
    """A trunk whose forward takes no ``position_ids`` and counts positions from the first column (as
    DistilBERT-style encoders do)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_a_trunk_without_position_ids_is_right_aligned():
    trunk = _NoPositionsTrunk(_trunk("bert"))
    model = RewardModel(RewardModelConfig(dropout_prob=0.0), trunk=trunk).eval()
    assert model.position_mode == "right_align"
    seqs = _sequences(0)
    ids, mask = _batch(seqs, 0, "left")
    with torch.no_grad():
        torch.testing.assert_close(model.score(ids, mask), _own_scores(model, seqs, "last"), rtol=1e-4, atol=1e-4)
        hidden = trunk_hidden(trunk, ids, mask, "right_align", use_cache=False)
        plain = trunk(input_ids=seqs[0][None], attention_mask=torch.ones_like(seqs[0])[None]).last_hidden_state
    torch.testing.assert_close(hidden[0][mask[0].bool()], plain[0], rtol=1e-4, atol=1e-4)


def test_probe_restores_train_mode():
    trunk = _trunk("bert").train()
    model = RewardModel(RewardModelConfig(dropout_prob=0.0), trunk=trunk)
    assert model.position_mode == "mask"
    assert all(m.training for m in trunk.modules())


@pytest.mark.parametrize(("arch", "mode"), [("roberta", "none"), ("bert", "mask"), ("llama", "mask")])
def test_the_probe_decides_the_same_in_bfloat16(arch, mode):
    from aitraining_pl.models.trunk_positions import choose_position_mode

    trunk = _trunk(arch).to(torch.bfloat16)
    chosen, errors = choose_position_mode(trunk, takes_positions=True, use_cache=arch == "llama")
    assert chosen == mode, errors


def test_a_trunk_the_probe_cannot_run_falls_back_to_mask_positions(monkeypatch, caplog):
    import aitraining_pl.models.trunk_positions as positions

    def broken(*args, **kwargs):
        raise RuntimeError("cannot probe")

    monkeypatch.setattr(positions, "probe_position_errors", broken)
    model = RewardModel(RewardModelConfig(dropout_prob=0.0), trunk=_trunk("llama"))
    with caplog.at_level("WARNING"):
        assert model.position_mode == "mask"
    assert "position probe failed" in caplog.text
