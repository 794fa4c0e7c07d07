"""Token-budget micro-batches: which rows go into which forward/backward pass, and what share of the batch's loss
each pass carries (``token_budget`` of every module; docs/long_context.md).

Rows are split by a balanced bin-packing, the largest differencing method of Karmarkar and Karp (1982) for k-way
number partitioning, as verl's ``seqlen_balancing.karmarkar_karp`` does it for ``use_dynamic_bsz`` (its code does
not carry over): every row starts as a k-way partition of its own (itself in one part, the other parts empty);
the two partitions with the largest spread (largest part sum minus smallest) are merged, the largest part of one
with the smallest of the other, until one partition is left. The fewest micro-batches whose parts all fit the
budget are searched from ``ceil(tokens / budget)`` upwards. The same partition with equal row counts balances the
tokens of data-parallel ranks (``balance_ranks``).

The losses stay the batch's: a micro-batch's loss, computed with its own normaliser, times its ``loss_share``
(its normaliser over the batch's) sums over the micro-batches to the batch's loss, for every aggregation.

Pure functions (lists of ints in, lists of row indices out; ``loss_share`` on tensors).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from aitraining_pl.errors import ConfigError


class TokenBudgetError(ConfigError):
    """A row (or pair) longer than ``token_budget``: it fits no micro-batch."""


def karmarkar_karp(lengths: Sequence[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups whose sums are balanced (Karmarkar-Karp largest differencing).

    Args:
        lengths: a non-negative size per item (tokens of a row).
        parts: the number of groups (>= 1); groups may be empty when there are fewer items.
        equal_size: every group gets the same number of items (``len(lengths)`` must be a multiple of ``parts``):
            the items, sorted, enter ``parts`` at a time, one per group (verl's); then swaps between the largest and
            the smallest group even them out while one narrows their gap.

    Returns:
        ``parts`` lists of indices, each sorted, ordered by decreasing sum (ties: by first index).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    n = len(lengths)
    if equal_size and n % parts:
        raise ValueError(f"equal_size: {n} items do not split into {parts} equal groups")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    if equal_size:
        seeds = [order[start : start + parts] for start in range(0, n, parts)]
    else:
        seeds = [[i] for i in order]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie, items in enumerate(seeds):
        groups = [(lengths[i], [i]) for i in items] + [(0, []) for _ in range(parts - len(items))]
        groups.sort(key=lambda g: -g[0])
        heapq.heappush(heap, (-(groups[0][0] - groups[-1][0]), tie, groups))
    tie = len(seeds)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # the largest group of one with the smallest of the other: the spreads cancel
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda g: -g[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    groups = heap[0][2] if heap else [(0, []) for _ in range(parts)]
    result = [list(g[1]) for g in groups]
    if equal_size:  # differencing pairs of sorted neighbours leaves little to cancel a long row: swap to even out
        _even_out(result, lengths)
    result = [sorted(g) for g in result]
    result.sort(key=lambda g: (-sum(lengths[i] for i in g), g[0] if g else n))
    return result


def _even_out(groups: list[list[int]], lengths: Sequence[int]) -> None:
    """Swap items between the largest and the smallest group (sizes kept) while a swap narrows their gap, each time
    the swap that brings them closest: a local improvement after the equal-size differencing."""
    for _ in range(sum(len(g) for g in groups) ** 2):
        sums = [sum(lengths[i] for i in g) for g in groups]
        high, low = sums.index(max(sums)), sums.index(min(sums))
        gap = sums[high] - sums[low]
        best = None
        for a, i in enumerate(groups[high]):
            for b, j in enumerate(groups[low]):
                moved = lengths[i] - lengths[j]
                if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                    best = (abs(gap - 2 * moved), a, b)
        if best is None or best[0] >= gap:
            return
        _, a, b = best
        groups[high][a], groups[low][b] = groups[low][b], groups[high][a]


def check_row_lengths(lengths: Sequence[int], budget: int, row_limit: int | None = None, what: str = "row") -> None:
    """A ``TokenBudgetError`` naming the first row (or pair: ``what``) longer than ``row_limit`` (default: the
    budget) with its length and the budget."""
    limit = budget if row_limit is None else row_limit
    for i, length in enumerate(lengths):
        if length > limit:
            raise TokenBudgetError(
                "token_budget",
                f"{what} {i} of the batch has {int(length)} tokens, more than the token budget of {budget} tokens "
                f"per micro-batch: raise token_budget (or lower the data's max_length / generation.max_new_tokens)",
            )


def token_budget_partition(
    lengths: Sequence[int], budget: int, min_parts: int = 1, row_limit: int | None = None, what: str = "row"
) -> list[list[int]]:
    """The rows of a batch in the fewest micro-batches (at least ``min_parts``) of at most ``budget`` tokens each,
    balanced by ``karmarkar_karp``; empty micro-batches are dropped.

    Args:
        lengths: tokens of each row (or pair, kept together).
        budget: tokens per micro-batch (``token_budget``).
        min_parts: at least this many micro-batches (e.g. the most any data-parallel rank needs).
        row_limit: the longest row allowed (default: ``budget``); a row above ``budget`` but within it goes alone into
            a micro-batch of its own. The hook for sequence parallelism, which splits one row across its group (its
            limit is ``budget`` times the group's size); without it a longer row is a ``TokenBudgetError``.
        what: the unit's name in the error (``row``, ``pair``).

    Returns:
        Lists of row indices, each sorted; every row in exactly one.
    """
    if budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {budget}")
    check_row_lengths(lengths, budget, row_limit, what)
    n = len(lengths)
    if n == 0:
        return []
    over = [i for i, length in enumerate(lengths) if length > budget]  # within row_limit: alone each
    rest = [i for i in range(n) if lengths[i] <= budget]
    parts = max(min_parts - len(over), math.ceil(sum(lengths[i] for i in rest) / budget), 1 if rest else 0)
    while True:
        groups = karmarkar_karp([lengths[i] for i in rest], parts) if rest else []
        if all(sum(lengths[rest[j]] for j in g) <= budget for g in groups):
            break
        parts += 1  # ends: with one row per part every part fits
    return [[i] for i in over] + [[rest[j] for j in g] for g in groups if g]


def contiguous_budget_split(
    lengths: Sequence[int], budget: int, max_rows: int | None = None, row_limit: int | None = None
) -> list[range]:
    """Consecutive runs of rows of at most ``budget`` tokens (and ``max_rows`` rows) each, in order: the no-grad
    passes, whose outputs are concatenated in row order. A row longer than ``row_limit`` (default: the budget) is a
    ``TokenBudgetError``; one above the budget but within it is a run of its own (``token_budget_partition``)."""
    check_row_lengths(lengths, budget, row_limit)
    runs, start, total = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (total + length > budget or (max_rows is not None and i - start >= max_rows)):
            runs.append(range(start, i))
            start, total = i, 0
        total += length
    if start < len(lengths):
        runs.append(range(start, len(lengths)))
    return runs


def balance_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """The rows of a global batch among ``ranks`` data-parallel ranks, the same number each, with balanced token
    counts (``karmarkar_karp`` with equal sizes; verl's ``_balance_batch``). ``len(lengths)`` must be a multiple of
    ``ranks``. Group ``r`` goes to rank ``r``."""
    return karmarkar_karp(lengths, ranks, equal_size=True)


def normaliser(aggregation: str, mask: torch.Tensor) -> float:
    """What a loss of ``aggregation`` divides by on rows with the loss mask ``mask`` (n, R): ``token`` (a token mean:
    PPO, DAPO, SFT, distillation) the tokens in the loss, ``sequence`` (GRPO's mean of response means over the rows
    with a token) such rows, ``constant`` (Dr. GRPO's sum over rows x a constant) the rows."""
    if aggregation == "token":
        return float(mask.sum())
    if aggregation == "sequence":
        return float((mask.sum(1) > 0).sum())
    if aggregation == "constant":
        return float(mask.shape[0])
    raise ValueError(f"unknown loss aggregation {aggregation!r}; known: token, sequence, constant")


def loss_share(aggregation: str, micro_mask: torch.Tensor, batch_mask: torch.Tensor) -> float:
    """The weight of a micro-batch's loss, computed with its own normaliser, in the batch's loss: the micro-batch's
    ``normaliser`` over the batch's, so that the weighted losses of the micro-batches sum to the batch's loss.
    ``micro_mask``: (n, R) the micro-batch's loss mask; ``batch_mask``: (N, R) the batch's."""
    micro, batch = normaliser(aggregation, micro_mask), normaliser(aggregation, batch_mask)
    if batch == 0:  # no token in the batch's loss: each micro-batch's loss is 0 (or its plain sum, 0 as well)
        return micro_mask.shape[0] / max(1, batch_mask.shape[0])
    return micro / batch
