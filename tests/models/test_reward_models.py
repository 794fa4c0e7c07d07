"""Reward models: pooling, shapes, padding sides, heads, losses, save/load."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA

from aitraining_pl.losses import bradley_terry_loss, masked_objective_mse, pool_hidden_states
from aitraining_pl.models import (
    MultiObjectiveRewardModel,
    PairwiseRewardModel,
    RewardModel,
    RewardModelConfig,
    load_reward_model,
    with_padding_side,
)

TINY_BERT = {
    "model_type": "bert",
    "vocab_size": 384,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
}
TEXTS = ["short", "a somewhat longer text", "mid length", "x"]


def _config(**kw) -> RewardModelConfig:
    kw.setdefault("model_config", TINY_LLAMA)
    return RewardModelConfig(tokenizer_name="byte", dropout_prob=0.0, **kw)


def _encode(tokenizer, side: str, texts=TEXTS):
    return with_padding_side(tokenizer, side)(texts, padding=True, return_tensors="pt")


# ------------------------------------------------------------------ pooling maths
def test_pooling_picks_the_right_tokens_for_both_padding_sides():
    hidden = torch.arange(2 * 4, dtype=torch.float32).view(2, 4, 1)  # value = flat position
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert pool_hidden_states(hidden, right, "last").squeeze(-1).tolist() == [1.0, 7.0]
    assert pool_hidden_states(hidden, left, "last").squeeze(-1).tolist() == [3.0, 7.0]
    assert pool_hidden_states(hidden, right, "cls").squeeze(-1).tolist() == [0.0, 4.0]
    assert pool_hidden_states(hidden, left, "cls").squeeze(-1).tolist() == [2.0, 4.0]
    assert pool_hidden_states(hidden, right, "mean").squeeze(-1).tolist() == [0.5, 5.5]
    assert pool_hidden_states(hidden, left, "mean").squeeze(-1).tolist() == [2.5, 5.5]
    with pytest.raises(ValueError, match="pooling_strategy"):
        pool_hidden_states(hidden, right, "max")


@pytest.mark.parametrize("trunk", [TINY_LLAMA, TINY_BERT], ids=["decoder", "encoder"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_shapes_and_padding_side_invariance(trunk, pooling, byte_tokenizer):
    model = RewardModel(_config(model_config=trunk, pooling_strategy=pooling, num_labels=2)).eval()
    right, left = _encode(byte_tokenizer, "right"), _encode(byte_tokenizer, "left")
    with torch.no_grad():
        out_right = model(right["input_ids"], right["attention_mask"])
        out_left = model(left["input_ids"], left["attention_mask"])
        alone = torch.stack([model(**_encode(byte_tokenizer, "right", [t]))[0] for t in TEXTS])
    assert out_right.shape == (len(TEXTS), 2) and model.score(**right).shape == (len(TEXTS),)
    torch.testing.assert_close(out_right, out_left, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_right, alone, atol=1e-5, rtol=1e-4)  # padding changes nothing


def test_temperature_divides_rewards(byte_tokenizer):
    enc = _encode(byte_tokenizer, "right")
    plain = RewardModel(_config()).eval()
    hot = RewardModel(_config(temperature=4.0)).eval()
    torch.testing.assert_close(hot.score(**enc), plain.score(**enc) / 4.0)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="pooling_strategy"):
        RewardModel(_config(pooling_strategy="max"))
    with pytest.raises(ValueError, match="exactly one"):
        RewardModel(RewardModelConfig())
    with pytest.raises(ValueError, match="objective_weights"):
        MultiObjectiveRewardModel(_config(), num_objectives=3, objective_weights=[1.0])


# ------------------------------------------------------------------ pairwise
def test_pairwise_forward_and_bradley_terry_labels(byte_tokenizer):
    from aitraining_pl.compat import PairwiseRewardModel  # the seed's methods are in the compatibility layer

    model = PairwiseRewardModel(_config()).eval()
    a, b = _encode(byte_tokenizer, "right", TEXTS[:2]), _encode(byte_tokenizer, "right", TEXTS[2:])
    ra, rb = model.score(**a), model.score(**b)
    prob = model.forward_pair(a["input_ids"], a["attention_mask"], b["input_ids"], b["attention_mask"])
    torch.testing.assert_close(prob, torch.sigmoid(ra - rb))
    labels = torch.tensor([1, 0])  # row 0: A preferred; row 1: B preferred
    loss = model.compute_bradley_terry_loss(
        a["input_ids"], a["attention_mask"], b["input_ids"], b["attention_mask"], labels
    )
    expected = bradley_terry_loss(torch.stack([ra[0], rb[1]]), torch.stack([rb[0], ra[1]]))
    torch.testing.assert_close(loss, expected)
    hand = -(torch.log(torch.sigmoid(ra[0] - rb[0])) + torch.log(torch.sigmoid(rb[1] - ra[1]))) / 2
    torch.testing.assert_close(loss, hand)


# ------------------------------------------------------------------ multi-objective
def test_multi_objective_shapes_and_combination(byte_tokenizer):
    model = MultiObjectiveRewardModel(_config(), num_objectives=3, objective_weights=[0.5, 0.3, 0.2]).eval()
    enc = _encode(byte_tokenizer, "right")
    out = model(enc["input_ids"], enc["attention_mask"], return_all_objectives=True)
    assert out["rewards"].shape == (4, 3) and out["combined_reward"].shape == (4, 1)
    torch.testing.assert_close(out["combined_reward"][:, 0], out["rewards"] @ torch.tensor([0.5, 0.3, 0.2]))
    torch.testing.assert_close(model.score(**enc), out["combined_reward"][:, 0])


def test_masked_objective_mse_hand_values():
    pred = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    target = torch.tensor([[0.0, float("nan")], [1.0, 1.0]])
    mask = torch.tensor([[True, False], [True, True]])
    total, per = masked_objective_mse(pred, target, mask)
    torch.testing.assert_close(per, torch.tensor([(1.0 + 4.0) / 2, 9.0]))
    torch.testing.assert_close(total, torch.tensor((2.5 + 9.0) / 2))
    total_nan, _ = masked_objective_mse(pred, target)  # NaN targets are masked by default
    torch.testing.assert_close(total_nan, total)


def test_masked_objective_gets_no_gradient(byte_tokenizer):
    from aitraining_pl.compat import MultiObjectiveRewardModel  # the seed's methods are in the compatibility layer

    model = MultiObjectiveRewardModel(_config(), num_objectives=3)
    enc = _encode(byte_tokenizer, "right")
    targets = torch.randn(4, 3)
    targets[:, 1] = float("nan")  # objective 1 unknown everywhere, and NaN must not leak
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[:, 1] = False
    mask[0, 2] = False  # objective 2 unknown for row 0 only
    total, per = model.compute_multi_objective_loss(enc["input_ids"], enc["attention_mask"], targets, mask)
    total.backward()
    assert per.shape == (3,) and per[1] == 0 and torch.isfinite(total)
    head = model.head
    assert torch.all(head.weight.grad[1] == 0) and head.bias.grad[1] == 0  # masked head: no gradient
    assert head.weight.grad[0].abs().sum() > 0 and head.weight.grad[2].abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # per row: row 0's target for objective 2 changes nothing
    targets2 = targets.clone()
    targets2[0, 2] = 1e6
    total2, _ = model.compute_multi_objective_loss(enc["input_ids"], enc["attention_mask"], targets2, mask)
    torch.testing.assert_close(total2, total)


# ------------------------------------------------------------------ save / load
@pytest.mark.parametrize("kind", ["plain", "lora", "encoder-lora", "pairwise", "multi"])
def test_save_load_round_trip(kind, tmp_path, byte_tokenizer):
    torch.manual_seed(0)
    if kind == "multi":
        model = MultiObjectiveRewardModel(_config(), num_objectives=2, objective_weights=[0.7, 0.3])
    elif kind == "pairwise":
        model = PairwiseRewardModel(_config(pooling_strategy="mean"))
    elif kind == "encoder-lora":
        model = RewardModel(_config(model_config=TINY_BERT, pooling_strategy="cls", use_lora=True, lora_rank=4))
    else:
        model = RewardModel(_config(use_lora=kind == "lora", lora_rank=4))
    with torch.no_grad():  # make the head and (under LoRA) the adapters non-trivial
        model.head.weight.normal_()
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    model.eval()
    expected = model.predict_rewards(TEXTS, byte_tokenizer, batch_size=2)
    folder = model.save_pretrained(tmp_path / "rm", tokenizer=byte_tokenizer)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "reward_config.json", "model.safetensors", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    json.loads((folder / "reward_config.json").read_text())  # plain JSON
    loaded = load_reward_model(folder).eval()
    assert type(loaded) is type(model)
    got = loaded.predict_rewards(TEXTS, batch_size=2)  # its own (saved) tokenizer
    tol = 1e-5 if kind.endswith("lora") else 0.0  # merging adapters rounds differently
    assert got == pytest.approx(expected, rel=tol, abs=tol)
    if kind.endswith("lora"):
        assert any("lora_" in n for n, _ in loaded.named_parameters())  # still trainable the same way
    else:
        assert type(model).from_pretrained(folder).predict_rewards(TEXTS, batch_size=2) == pytest.approx(
            expected, rel=tol, abs=tol
        )


def test_from_pretrained_refuses_the_wrong_class_and_non_reward_folders(tmp_path):
    folder = MultiObjectiveRewardModel(_config(), num_objectives=2).save_pretrained(tmp_path / "multi")
    with pytest.raises(ValueError, match="not a PairwiseRewardModel"):
        PairwiseRewardModel.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="reward_config.json"):
        RewardModel.from_pretrained(tmp_path)


def test_bf16_trunk_gives_float32_rewards_and_round_trips(tmp_path, byte_tokenizer):
    model = RewardModel(_config(dtype="bfloat16")).eval()
    assert next(model.trunk.parameters()).dtype == torch.bfloat16 and model.head.weight.dtype == torch.float32
    rewards = model.score(**_encode(byte_tokenizer, "right"))
    assert rewards.dtype == torch.float32 and torch.isfinite(rewards).all()
    folder = model.save_pretrained(tmp_path / "bf16", tokenizer=byte_tokenizer)
    loaded = load_reward_model(folder).eval()
    assert next(loaded.trunk.parameters()).dtype == torch.bfloat16
    assert loaded.predict_rewards(TEXTS) == model.predict_rewards(TEXTS, byte_tokenizer)
