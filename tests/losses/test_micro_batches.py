"""The token-budget partition (``losses.micro_batches``): Karmarkar-Karp balancing, the budget, the ranks' balance,
the too-long-row error and the loss shares."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from aitraining_pl.losses.micro_batches import (
    TokenBudgetError,
    balance_ranks,
    contiguous_budget_split,
    karmarkar_karp,
    loss_share,
    token_budget_partition,
)
from aitraining_pl.losses.policy_gradient import LOSS_AGGREGATIONS

#: long-tailed lengths, as reasoning traces have: most short, a few very long
SKEWED = [30, 25, 900, 40, 35, 60, 20, 480, 55, 45, 33, 28, 250, 70, 38, 22]


def _sums(groups, lengths):
    return [sum(lengths[i] for i in g) for g in groups]


def _is_partition(groups, n):
    flat = sorted(i for g in groups for i in g)
    return flat == list(range(n))


def test_karmarkar_karp_hand_example():
    # the textbook case: differencing 8-7 -> 1, then {6, 5, 4, 1}: 6-5 -> 1, {4, 1, 1}: 4-1 -> 3, {3, 1}: 3-1 -> 2;
    # the final difference 2 means sums 14 and 16 ({8, 6} against {7, 5, 4}; the best split, {8, 7} / {6, 5, 4}, is 0)
    groups = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert _is_partition(groups, 5)
    assert sorted(_sums(groups, [8, 7, 6, 5, 4])) == [14, 16]
    assert groups == [[1, 3, 4], [0, 2]]  # ordered by decreasing sum


def test_karmarkar_karp_close_to_the_best_split():
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 100) for _ in range(8)]
        groups = karmarkar_karp(lengths, 3)
        assert _is_partition(groups, 8) and len(groups) == 3
        best = min(
            max(s) - min(s)
            for labels in itertools.product(range(3), repeat=8)
            for s in [[sum(x for x, lab in zip(lengths, labels) if lab == p) for p in range(3)]]
        )
        spread = max(_sums(groups, lengths)) - min(_sums(groups, lengths))
        assert spread <= best + max(lengths) // 2  # a heuristic, but near the optimum


def test_budget_partition_fits_and_uses_the_fewest_parts():
    budget = 1000
    groups = token_budget_partition(SKEWED, budget)
    sums = _sums(groups, SKEWED)
    assert _is_partition(groups, len(SKEWED))
    assert max(sums) <= budget
    assert len(groups) == math.ceil(sum(SKEWED) / budget)  # 2131 tokens: 3 micro-batches
    # balanced: the 900-token row alone, the other 1231 tokens in two near-halves
    assert groups[0] == [2] and sorted(sums[1:]) == [606, 625]


def test_budget_partition_min_parts_and_single_rows():
    groups = token_budget_partition(SKEWED, 10_000, min_parts=4)
    assert len(groups) == 4 and _is_partition(groups, len(SKEWED))
    assert token_budget_partition([5, 5], 5) == [[0], [1]]
    assert token_budget_partition([], 5) == []


def test_a_row_longer_than_the_budget_is_named():
    with pytest.raises(TokenBudgetError, match=r"row 2 of the batch has 900 tokens, more than the token budget of 500"):
        token_budget_partition(SKEWED, 500)
    with pytest.raises(TokenBudgetError, match=r"pair 1 of the batch has 7 tokens"):
        token_budget_partition([3, 7], 5, what="pair")


def test_row_limit_is_the_sequence_parallel_hook():
    # a row above the budget but within row_limit (budget x sequence-parallel size) goes alone into its own part
    groups = token_budget_partition(SKEWED, 500, row_limit=1000)
    assert [2] in groups and _is_partition(groups, len(SKEWED))
    assert all(s <= 500 for g, s in zip(groups, _sums(groups, SKEWED)) if g != [2])


def test_contiguous_split_keeps_order_within_budget():
    runs = contiguous_budget_split(SKEWED, 1000)
    assert [i for r in runs for i in r] == list(range(len(SKEWED)))
    assert all(sum(SKEWED[i] for i in r) <= 1000 for r in runs)
    with pytest.raises(TokenBudgetError, match="row 2"):
        contiguous_budget_split(SKEWED, 800)


def test_ranks_get_balanced_token_counts():
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(5, 1)) for _ in range(32)]  # long-tailed, 14 to 795 tokens
    groups = balance_ranks(lengths, 4)
    assert _is_partition(groups, 32) and all(len(g) == 8 for g in groups)  # the same rows per rank
    balanced = _sums(groups, lengths)
    strided = [sum(lengths[r::4]) for r in range(4)]  # the distributed sampler's split: 984 to 2445 tokens
    assert balanced == [1625, 1625, 1624, 1623]  # the mean is 1624.25
    assert max(balanced) - min(balanced) < (max(strided) - min(strided)) / 5


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_loss_shares_sum_to_the_batch_loss(aggregation):
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 9, generator=g)
    mask = (torch.arange(9) < torch.tensor([[2], [9], [0], [5], [1], [7]])).float()  # row 2 has no token
    want = LOSS_AGGREGATIONS[aggregation](per_token, mask, 12)
    total = sum(
        LOSS_AGGREGATIONS[aggregation](per_token[rows], mask[rows], 12) * loss_share(aggregation, mask[rows], mask)
        for rows in ([0, 2], [1], [3, 4, 5])
    )
    torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-7)


def test_loss_share_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert loss_share("token", mask[:1], mask) == 2 / 3
    assert loss_share("sequence", mask[1:], mask) == 1 / 2  # the empty row is no response of the mean
    assert loss_share("constant", mask[1:], mask) == 2 / 3
