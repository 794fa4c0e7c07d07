"""Rollout helpers: response masks, score placement, per-token rewards, reward sources."""

from __future__ import annotations

import math

import pytest
import torch

from aitraining_pl.generation.backend import StopRule
from aitraining_pl.losses import place_scores, token_rewards
from aitraining_pl.losses import positions_from_mask as position_ids_from_mask
from aitraining_pl.rewards import (
    RewardError,
    WeightedRewards,
    build_reward_source,
    char_fraction_reward,
    score_responses,
)
from aitraining_pl.rollout import decode_responses, response_mask

EOS, PAD = 1, 0


def test_response_mask_ends_at_first_eos_inclusive():
    response = torch.tensor(
        [
            [10, 11, EOS, PAD, PAD],  # EOS mid-sequence, then padding
            [10, EOS, 12, EOS, 13],  # two EOS: the first one ends the response
            [EOS, PAD, PAD, PAD, PAD],  # empty response: just the EOS
            [10, 11, 12, 13, 14],  # no EOS: truncated at max_new_tokens
        ]
    )
    mask, ended = response_mask(response, EOS)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ended.tolist() == [True, True, True, False]


def test_response_mask_several_eos_ids_and_stop_strings():
    response = torch.tensor([[10, 7, 11, 12], [10, 11, 12, 13]])
    mask, ended = response_mask(response, [EOS, 7])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    stops = torch.tensor([-1, 1])
    mask, ended = response_mask(response, EOS, stops)
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]] and ended.tolist() == [False, True]


def test_stop_string_ends(byte_tokenizer):
    ids = byte_tokenizer(["ab\n\ncd", "abcdef"], add_special_tokens=False, padding=True, return_tensors="pt")[
        "input_ids"
    ]
    ends = StopRule(byte_tokenizer, ["\n\n"]).ends(ids)
    assert ends.tolist() == [3, -1]  # the token completing "\n\n" is the 4th byte


def test_score_goes_on_the_eos_token_not_the_padding_after_it():
    response = torch.tensor([[10, 11, EOS, PAD, PAD], [10, 11, 12, 13, 14]])
    mask, _ = response_mask(response, EOS)
    placed = place_scores(torch.tensor([2.0, -1.0]), mask)
    assert placed.tolist() == [[0, 0, 2.0, 0, 0], [0, 0, 0, 0, -1.0]]


def test_token_rewards_kl_penalty_plus_score():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -3.0], [-1.0, -2.0, -1.0, -1.0]])
    rewards, kl = token_rewards(torch.tensor([1.0, 3.0]), logprobs, ref, mask, kl_coef=0.1, estimator="k1")
    assert torch.allclose(kl, torch.tensor([[0.5, -1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    expected = torch.tensor([[-0.05, 0.1, 1.0, 0.0], [0.0, -0.1, 0.0, 3.0]])
    assert torch.allclose(rewards, expected)
    _, kl3 = token_rewards(torch.zeros(2), logprobs, ref, mask, kl_coef=0.1, estimator="k3")
    r = -0.5  # ref - logp at [0, 0]
    assert kl3[0, 0].item() == pytest.approx(math.expm1(r) - r)


def test_position_ids_follow_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_decode_responses_stops_at_mask(byte_tokenizer):
    ids = torch.tensor([byte_tokenizer("hi", add_special_tokens=False)["input_ids"] + [EOS, 70, 71]])
    mask, _ = response_mask(ids, EOS)
    assert decode_responses(byte_tokenizer, ids, mask) == ["hi"]


# ------------------------------------------------------------------------------ reward sources


def test_reward_source_from_import_path_and_components():
    source = build_reward_source(
        {
            "components": {
                "vowels": {"source": "aitraining_pl.rewards:char_fraction_reward", "weight": 2.0},
                "length": {"source": "aitraining_pl.rewards.char_length_reward", "kwargs": {}},
            }
        }
    )
    assert isinstance(source, WeightedRewards)
    scores, components = score_responses(source, ["p", "q"], ["aab", "xyz"], [{}, {"target_length": 3}])
    assert components["vowels"] == pytest.approx([2 / 3, 0.0])
    assert components["length"] == pytest.approx([0.03, 1.0])
    assert scores == pytest.approx([4 / 3 + 0.03, 1.0])
    assert char_fraction_reward([""], ["xyz"], [{"target_chars": "xy"}]) == pytest.approx([2 / 3])


def test_reward_source_from_class_path():
    source = build_reward_source(
        {
            "class_path": "aitraining_pl.rewards.WeightedRewards",
            "init_args": {"components": {"len": lambda p, r, m: [1.0] * len(r)}},
        }
    )
    assert score_responses(source, ["a"], ["b"], [{}])[0] == [1.0]


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda p, r, m: [1.0], "returned 1 scores for 2 responses"),
        (lambda p, r, m: [1.0, float("nan")], "non-finite"),
        (lambda p, r, m: 1 / 0, "raised ZeroDivisionError"),
        (lambda p, r, m: None, "not a list of floats"),
    ],
)
def test_bad_reward_sources_stop_with_a_message(fn, message):
    with pytest.raises(RewardError, match=message):
        score_responses(fn, ["a", "b"], ["x", "y"], [{}, {}])


def test_bad_reward_spec():
    with pytest.raises(ValueError, match="has no attribute"):
        build_reward_source("aitraining_pl.rewards:nope")
    with pytest.raises(ValueError, match="cannot build a reward source"):
        build_reward_source({"weird": 1})


def test_reward_model_folder_is_a_reward_source(tmp_path):
    from conftest import TINY_LLAMA

    from aitraining_pl.models.reward import RewardModel, RewardModelConfig

    model = RewardModel(RewardModelConfig(model_config=dict(TINY_LLAMA), tokenizer_name="byte", dropout_prob=0.0))
    torch.nn.init.normal_(model.head.weight)
    model.save_pretrained(tmp_path / "rm")
    source = build_reward_source(str(tmp_path / "rm"), kwargs={"batch_size": 2})
    scores, _ = score_responses(source, ["Q: ", "Q: ", "Q: "], ["yes", "no", "maybe"], [{}, {}, {}])
    expected = model.eval().predict_rewards(["Q: yes", "Q: no", "Q: maybe"])
    assert scores == pytest.approx(expected, abs=1e-5) and len(set(scores)) == 3
