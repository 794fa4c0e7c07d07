"""Training loaders that resume mid-epoch: ``ResumableDataLoader`` and ``SeededShuffleSampler``.

Lightning saves and restores the ``state_dict()`` / ``load_state_dict()`` of a training dataloader that has
them (``lightning.fabric.utilities.types._Stateful``; the fit loop calls ``load_state_dict`` before it
creates the iterator). A resumed run then continues at the batch after the checkpoint instead of replaying
the epoch's first batches and never training its last ones.

The order of an epoch must be a function of the epoch alone for this to be exact: ``SeededShuffleSampler``
(and ``LengthGroupedSampler``) derive it from ``seed + epoch`` with a private generator, never from the global
random state, and the loader is given its own ``generator`` so creating its iterator draws nothing from the
global stream either (generation and dropout see the same random numbers with or without a resume).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class SeededShuffleSampler(Sampler[int]):
    """A random permutation of ``range(n)`` per epoch, drawn from ``seed + epoch`` (Lightning calls
    ``set_epoch`` at the start of every epoch).

    Args:
        n: number of examples.
        seed: base seed of the permutation.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())


class _SkipFirst:
    """``batch_sampler`` without its first ``skip`` batches (of indices: no example is loaded), once: a second
    pass (persistent workers re-iterate the same object) yields every batch."""

    def __init__(self, batch_sampler: Iterable, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.batch_sampler), skip, None)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that counts the batches it handed out in the current pass and, after
    ``load_state_dict``, starts its next pass after that many batches (skipped as indices, not loaded).

    State: ``{"batches": n}``. A state taken at the end of a pass (``n >= len(self)``) starts the next pass
    from its first batch. Takes the arguments of ``torch.utils.data.DataLoader``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._batches = 0  # handed out in the current pass
        self._resume_at = 0  # batches to skip at the start of the next pass
        self._skip = 0  # read by _index_sampler while the next iterator is being built

    @property
    def _index_sampler(self):  # type: ignore[override]
        base = super()._index_sampler
        return _SkipFirst(base, self._skip) if self._skip else base

    def __iter__(self) -> Iterator[Any]:
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        # a generator: nothing runs until the first ``next``, after Lightning's ``set_epoch``
        skip, self._resume_at = self._resume_at, 0
        if isinstance(self.batch_sampler, Sized) and skip >= len(self.batch_sampler):
            skip = 0
        self._skip = skip
        try:
            iterator = super().__iter__()
        finally:
            self._skip = 0
        self._batches = skip
        for batch in iterator:
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches": self._batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_at = int(state_dict.get("batches", 0))
        self._batches = self._resume_at


class RankBalancedSampler(Sampler[int]):
    """``sampler``'s order rearranged so that the data-parallel ranks' batches carry balanced token counts
    (``losses.micro_batches.balance_ranks``, verl's ``_balance_batch``): each run of ``batch_size * ranks`` indices
    (one step of every rank) is dealt so that the distributed sampler's split, index ``j`` to rank ``j % ranks``,
    gives rank ``r`` the ``r``-th balanced group. The rows of a step stay that step's; a last, shorter run is left as
    it is. ``set_epoch`` reaches ``sampler``.

    Args:
        sampler: the order (indices into the dataset).
        lengths: tokens of each example.
        batch_size: rows per rank and step.
        ranks: data-parallel ranks.
    """

    def __init__(self, sampler: Iterable[int], lengths: list[int], batch_size: int, ranks: int):
        self.sampler, self.lengths, self.batch_size, self.ranks = sampler, list(lengths), batch_size, ranks

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        from aitraining_pl.losses.micro_batches import balance_ranks

        order, step = list(self.sampler), self.batch_size * self.ranks
        dealt = []
        for start in range(0, len(order), step):
            run = order[start : start + step]
            if len(run) < step:
                dealt.extend(run)
                break
            groups = balance_ranks([self.lengths[i] for i in run], self.ranks)
            dealt.extend(run[groups[r][j]] for j in range(self.batch_size) for r in range(self.ranks))
        return iter(dealt)
