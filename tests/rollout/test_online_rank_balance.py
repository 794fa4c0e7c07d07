"""Online rows balanced across data-parallel ranks (``balance_ranks``, ``rollout.rank_balance``): re-padding keeps
every row's tokens, the dealing is an equal-count Karmarkar-Karp over the ranks, and on 2 gloo ranks each row moves
whole (tokens, masks, routes, log-probs, scores, texts, reward components and its prompt together), groups stay
together and contiguous, and the ranks' real tokens even out."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from rank_balance_worker import LAYOUT, rollout_of, worker

from aitraining_pl.errors import ConfigError
from aitraining_pl.rollout.rank_balance import check_balanceable, deal_groups, imbalance, repad


def _rows(batch: dict | object) -> dict[str, tuple]:
    """Each row's real prompt and response tokens, routes, sampler log-probs, score, component and ended flag,
    keyed by its text (padding removed)."""
    b = batch if isinstance(batch, dict) else vars(batch)
    P, out = b["prompt_length"], {}
    for i, text in enumerate(b["texts"]):
        keep = b["attention_mask"][i].bool()
        response = b["mask"][i].bool()
        out[text] = (
            b["input_ids"][i][keep].tolist(),
            b["routes"][i][keep].flatten().tolist(),
            b["sampling_logprobs"][i][response].tolist(),
            b["input_ids"][i, P:][response].tolist(),
            float(b["scores"][i]),
            b["components"]["c"][i],
            bool(b["ended"][i]),
        )
    return out


def test_repad_keeps_every_row_and_pads_with_the_fields_values():
    batch, _ = rollout_of(0)
    wider = repad(batch, 5, 7, pad_id=7)
    assert wider.prompt_length == 5 and wider.input_ids.shape == (4, 12) and wider.mask.shape == (4, 7)
    assert _rows(wider) == _rows(batch)
    assert (wider.input_ids[:, :2] == 7).all() and (wider.input_ids[:, -2:] == 7).all()
    assert (wider.attention_mask[:, :2] == 0).all() and (wider.routes[:, :2] == 0).all()
    assert repad(batch, 3, 5) is batch
    with pytest.raises(ValueError, match="cannot shorten"):
        repad(batch, 2, 2)


def test_groups_are_dealt_in_equal_counts_with_balanced_tokens():
    tokens = [[10, 10, 11], [30, 31, 29]]
    dealt = deal_groups(tokens)
    assert sorted(pair for part in dealt for pair in part) == [(r, g) for r in range(2) for g in range(3)]
    assert [len(part) for part in dealt] == [3, 3]
    sums = [sum(tokens[r][g] for r, g in part) for part in dealt]
    assert imbalance(sums) < imbalance([31, 90]) and max(sums) - min(sums) <= 21
    assert all(part == sorted(part) for part in dealt)
    assert imbalance([5, 5]) == 0.0 and imbalance([0, 0]) == 0.0


def test_episodes_and_per_row_images_are_refused():
    batch, _ = rollout_of(0)
    batch.vision = object()
    with pytest.raises(ConfigError, match="Test.balance_ranks: .*vision.*set balance_ranks false"):
        check_balanceable(batch, "Test")


@pytest.mark.ddp
def test_two_gloo_ranks_exchange_whole_rows_and_even_out_their_tokens(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(str(tmp_path), port), nprocs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    original = {**_rows(rollout_of(0)[0]), **_rows(rollout_of(1)[0])}
    received = {}
    for rank in got:
        batch = rank["batch"]
        assert batch["prompt_length"] == 4 and batch["mask"].shape[1] == 6  # the ranks' common lengths
        assert batch["group"].tolist() == [0, 0, 1, 1]  # 2 groups of 2 rows each, contiguous
        received.update(_rows(batch))
        for row, text in enumerate(batch["texts"]):  # each row's prompt is its group's
            source, index = int(text[1]), int(text.split("-")[1])
            assert rank["prompts"][int(batch["group"][row])] == f"prompt r{source} g{index // 2}"
    assert received == original  # every row arrived once, whole
    tokens = [int(rank["batch"]["attention_mask"].sum()) for rank in got]
    before = [sum(2 + r for r in LAYOUT[0][2][:2]) + sum(3 + r for r in LAYOUT[0][2][2:]),
              sum(2 + r for r in LAYOUT[1][2][:2]) + sum(4 + r for r in LAYOUT[1][2][2:])]  # fmt: skip
    assert sum(tokens) == sum(before) and imbalance(tokens) < imbalance(before)
    assert got[0]["stats"]["rank_tokens/imbalance_before"] == pytest.approx(imbalance(before))
    assert got[0]["stats"]["rank_tokens/imbalance_after"] == pytest.approx(imbalance(tokens))
