"""Reward functions as TRL users write them: ``None`` for a row a function does not apply to, and every extra
dataset column by name."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.errors import RewardError
from aitraining_pl.modules.online import OnlineRLModule, RolloutBatch
from aitraining_pl.rewards import ColumnKeywordReward, WeightedRewards, build_reward_source, score_responses


def _fixed(values):
    return lambda prompts, responses, metadata: list(values)


def test_a_row_one_of_two_functions_skips_gets_the_others_weighted_score_only():
    source = WeightedRewards(
        {"format": _fixed([1.0, None, 3.0]), "answer": _fixed([4.0, 5.0, None])}, {"format": 2.0, "answer": 0.5}
    )
    scores, components = score_responses(source, ["p"] * 3, ["a", "b", "c"], [{}] * 3)
    assert scores == [2.0 * 1.0 + 0.5 * 4.0, 0.5 * 5.0, 2.0 * 3.0]
    assert components == {"format": [1.0, None, 3.0], "answer": [4.0, 5.0, None]}


def test_a_row_no_function_scores_gets_zero_with_a_warning():
    source = WeightedRewards({"a": _fixed([None, 1.0]), "b": _fixed([None, 2.0])})
    with pytest.warns(UserWarning, match="every reward component returned None for 1 of 2 responses"):
        assert source(["p", "p"], ["x", "y"], [{}, {}]) == [0.0, 3.0]


def test_a_lone_source_may_not_return_none():
    with pytest.raises(RewardError, match=r"returned a NoneType \(None\) at index 1, not a float \(None is allowed"):
        score_responses(_fixed([1.0, None]), ["p", "p"], ["x", "y"], [{}, {}])


def test_component_means_leave_out_the_rows_a_component_skipped():
    rollout = RolloutBatch(
        input_ids=torch.zeros(3, 4, dtype=torch.long),
        attention_mask=torch.ones(3, 4, dtype=torch.long),
        prompt_length=2,
        mask=torch.ones(3, 2),
        ended=torch.ones(3, dtype=torch.bool),
        group=torch.tensor([0, 0, 1]),
        texts=["a", "b", "c"],
        scores=torch.tensor([1.0, 2.0, 3.0]),
        components={"format": [1.0, None, 3.0], "answer": [None, None, None]},
    )
    owner = SimpleNamespace(episode_stats=lambda r: OnlineRLModule.episode_stats(None, r))  # no model needed
    stats = OnlineRLModule.rollout_stats(owner, rollout)
    assert stats["reward/format"].item() == pytest.approx(2.0)
    assert math.isnan(stats["reward/answer"].item())  # no row applied: no mean (not a made-up 0)


def trl_style_reward(completions, answer, level, **kwargs):
    """Written for TRL: the extra columns arrive as keyword arguments, one value per completion."""
    return [float(c == a) + 0.1 * lv for c, a, lv in zip(completions, answer, level)]


def test_trl_style_functions_get_every_extra_column_by_name(tmp_path, byte_tokenizer):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "2+2=", "answer": "4", "level": 1}, {"prompt": "3+3=", "answer": "6", "level": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = PromptDataModule(data_path=str(path), tokenizer=byte_tokenizer, batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs, prompts=prompts)
        return [0.0] * len(completions)

    for spec in (spy, {"components": {"spy": {"source": spy}}}):
        seen.clear()
        source = build_reward_source(spec)
        score_responses(source, batch["prompts"], ["4", "7"], batch["metadata"])
        assert seen == {"prompts": batch["prompts"], "answer": ["4", "6"], "level": [1, 2]}
    source = build_reward_source(f"{__name__}:trl_style_reward")
    assert isinstance(source, ColumnKeywordReward)
    order = [r["prompt"] for r in rows]
    metadata = [batch["metadata"][batch["prompts"].index(p)] for p in order]
    assert source(order, ["4", "7"], metadata) == pytest.approx([1.1, 0.2])
    # the protocol's own functions are left as they are
    assert not isinstance(build_reward_source("aitraining_pl.rewards:char_fraction_reward"), ColumnKeywordReward)
