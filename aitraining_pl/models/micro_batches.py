"""A batch's forward in token-budget micro-batches, for the modules that train under Lightning's automatic
optimisation (SFT, the DPO family, KTO, ORPO / CPO, reward models): ``budgeted_forward``.

Such a module returns one loss per batch and Lightning runs its backward, so a micro-batch cannot have a backward
of its own. Instead each micro-batch's forward but the last runs under ``torch.utils.checkpoint`` (non-reentrant):
only its outputs (a few numbers per row) are kept, and the backward recomputes its activations one micro-batch at
a time. The loss is then computed on the whole batch's outputs, as without a budget: the same normalisers, the
same batch-level terms (KTO's KL estimate, AOT's sorting), the same loss for every objective. The price is one
more forward for every micro-batch but the last (as activation checkpointing, Chen et al. 2016); the peak holds
one micro-batch's activations. The online modules, under manual optimisation, run a backward per micro-batch
instead and pay no second forward (``modules.online``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from aitraining_pl.losses.micro_batches import token_budget_partition
from aitraining_pl.models.sequence_parallel import group_size


def unit_lengths(attention_mask: torch.Tensor, paired: bool) -> list[int]:
    """Real tokens of each row, or with ``paired`` of each pair (row ``i`` and row ``i + B`` of 2B rows)."""
    lengths = attention_mask.sum(1)
    if paired:
        lengths = sum(lengths.chunk(2))
    return [int(x) for x in lengths.tolist()]


def take_rows(batch: Mapping[str, Any], units: torch.Tensor, n_units: int, paired: bool) -> dict[str, Any]:
    """The rows of ``batch`` for ``units`` (with ``paired``, both rows of each pair: first rows, then second rows,
    so the sub-batch keeps the 2B contract); per-pair tensors (B,) by unit; objects with ``rows`` (images) by row;
    other values as they are. Trailing columns that are padding in every row taken are cut."""
    rows = torch.cat([units, units + n_units]) if paired else units
    n_rows = 2 * n_units if paired else n_units
    taken: dict[str, Any] = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n_rows:
            taken[key] = value[rows.to(value.device)]
        elif torch.is_tensor(value) and value.dim() > 0 and paired and value.shape[0] == n_units:
            taken[key] = value[units.to(value.device)]
        elif hasattr(value, "rows"):
            taken[key] = value.rows(rows)
        else:
            taken[key] = value
    real = taken["attention_mask"].bool().any(0)
    width = int(real.nonzero().max()) + 1 if real.any() else 1
    full = taken["attention_mask"].shape[1]
    if width < full:
        for key, value in taken.items():
            if torch.is_tensor(value) and value.dim() == 2 and value.shape == (len(rows), full):
                taken[key] = value[:, :width]
    return taken


def _reassemble(
    pieces: list[list[torch.Tensor]], index: list[torch.Tensor], widths: list[int], full: int, per_position: bool
) -> list[torch.Tensor]:
    """Each output's pieces in batch order: ``index[k]`` are the rows (or units) of piece ``k``; with
    ``per_position``, outputs of 2 dimensions or more come back zero-padded on the right to the batch's width."""
    result = []
    for j in range(len(pieces[0])):
        parts = []
        for k, piece in enumerate(pieces):
            value = piece[j]
            if per_position and value.dim() >= 2 and full > widths[k]:
                value = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, full - widths[k]))
            parts.append(value)
        order = torch.cat([ix.to(parts[0].device) for ix in index])
        merged = torch.cat(parts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        result.append(merged[inverse])
    return result


def budgeted_forward(
    fn: Callable[[dict[str, Any]], Any],
    batch: Mapping[str, Any],
    budget: int | None,
    paired: bool = False,
    row_limit: int | None = None,
    per_position: bool = False,
) -> Any:
    """``fn(batch)`` computed in micro-batches of at most ``budget`` real tokens (``token_budget``), balanced
    (``losses.micro_batches.token_budget_partition``; pairs kept together with ``paired``), each but the last
    checkpointed when gradients are on (the module docstring). ``None`` or a batch that fits: ``fn(batch)`` itself.

    Args:
        fn: the batch's forward: a dict like ``batch`` (``input_ids``, ``attention_mask``, ...) in, tensors out (a
            tensor, tuple, NamedTuple or dict), each with one entry per row or per pair in its first dimension.
        batch: the rows (2B of them with ``paired``: row ``i`` and row ``i + B`` form pair ``i``).
        budget: tokens per micro-batch.
        paired: keep row ``i`` and row ``i + B`` in one micro-batch (preference pairs, KTO's mismatched rows).
        row_limit: the longest row allowed (``token_budget_partition``; default: ``budget`` times the
            sequence-parallel group's size, ``models.sequence_parallel``, whose ranks split a longer row).
        per_position: ``fn``'s outputs are per position, ``(rows, columns, ...)``: a micro-batch's trailing columns
            that are padding in all its rows are cut before ``fn`` and come back as zeros. Otherwise the outputs are
            per row or per pair only (any further dimensions are kept as they are).

    Returns:
        What ``fn`` returns for the whole batch, entries in the batch's order.
    """
    if not budget:
        return fn(dict(batch))
    mask = batch["attention_mask"]
    lengths = unit_lengths(mask, paired)
    row_limit = budget * group_size() if row_limit is None else row_limit  # the sequence-parallel group splits it
    groups = token_budget_partition(lengths, budget, row_limit=row_limit, what="pair" if paired else "row")
    if len(groups) <= 1:
        return fn(dict(batch))
    n_units, full = len(lengths), mask.shape[1]
    pieces, index, widths, spec = [], [], [], None
    for k, group in enumerate(groups):
        units = torch.tensor(group, dtype=torch.long, device=mask.device)
        sub = take_rows(batch, units, n_units, paired)
        last = k == len(groups) - 1
        if torch.is_grad_enabled() and not last:  # the backward recomputes it; the last one's activations are used
            out = checkpoint(fn, sub, use_reentrant=False)
        else:
            out = fn(sub)
        tensors, spec = tree_flatten(out)  # a tensor, or tuples / NamedTuples / dicts of them
        n_rows = 2 * len(group) if paired else len(group)
        rows = torch.cat([units, units + n_units]) if paired else units
        pieces.append(tensors)
        index.append([rows if t.shape[0] == n_rows else units for t in tensors])
        widths.append(sub["attention_mask"].shape[1])
    outputs = []
    for j in range(len(pieces[0])):  # each output may be per row or per pair
        outputs.extend(_reassemble([[p[j]] for p in pieces], [ix[j] for ix in index], widths, full, per_position))
    return tree_unflatten(outputs, spec)
