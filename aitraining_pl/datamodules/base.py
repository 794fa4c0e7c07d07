"""``TextDataModule``: the tokenizer, reading, train/validation split and loaders the text data modules share."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from aitraining_pl.datamodules.io import DataSource, DataValidationError, data_sources, read_records
from aitraining_pl.datamodules.resumable import RankBalancedSampler, ResumableDataLoader, SeededShuffleSampler
from aitraining_pl.validation import Ranges, check_arguments, rules, save_hparams

#: Source name of in-memory data in error messages.
IN_MEMORY = "<in-memory>"


def holdout_indices(n: int, fraction: float, seed: int, source: str) -> tuple[list[int], list[int]]:
    """Seeded split of ``range(n)`` into (train, validation) indices, ``fraction`` (at least one) held out."""
    if not 0 < fraction < 1:
        raise ValueError(f"val_split must be in [0, 1), got {fraction}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(round(fraction * n)))
    if n_val >= n:
        raise DataValidationError(source, f"val_split={fraction} leaves no training rows ({n} rows)")
    return sorted(order[n_val:]), sorted(order[:n_val])


def holdout(rows: Sequence[Any], fraction: float, seed: int, source: str) -> tuple[list, list]:
    """Seeded split of ``rows`` into (train, validation), ``fraction`` (at least one row) held out, in order."""
    train, val = holdout_indices(len(rows), fraction, seed, source)
    return [rows[i] for i in train], [rows[i] for i in val]


def _read(source: DataSource) -> list[dict]:
    return read_records(
        source.path, source.split, name=source.name, data_files=source.data_files, revision=source.revision
    )


#: ranges of the arguments every data module has; a data module adds its own.
DATA_RANGES = rules("batch_size", "eval_batch_size", "val_split", "num_workers")


class TextDataModule(pl.LightningDataModule):
    """Base of the text data modules. It declares no arguments: a subclass declares, documents and saves its
    own (``data_path``, ``split``, ``val_data_path``, ``val_split``, ``batch_size``, ``eval_batch_size``,
    ``num_workers``, ``seed``, ...), and provides ``_in_memory_records()``, ``_rows(records, source)`` (check
    every row; return what is split: records or tokenised examples), optionally ``_dataset(rows, source)``,
    a ``collator`` class and ``train_dataloader`` (usually ``self._loader(self.train_dataset, batch_size, ...)``).
    """

    #: allowed values of the constructor's arguments (``validation.check_arguments``), checked by ``save_arguments``
    argument_ranges: ClassVar[Ranges] = {}

    def __init__(self, tokenizer: Any, in_memory: tuple):
        super().__init__()
        self._tokenizer = tokenizer
        self._in_memory = in_memory
        self.train_dataset: Any = None
        self.val_dataset: Any = None

    def save_arguments(self, arguments: dict[str, Any]) -> None:
        """Store the constructor's arguments (``validation.constructor_arguments``: in-memory data left out) as the
        hyperparameters in one step, each checked first, once, against the class's ``argument_ranges``
        (``batch_size >= 1``, ``0 <= val_split < 1``, ...), before any reading."""
        check_arguments(type(self).argument_ranges, arguments, type(self).__name__)
        save_hparams(self, arguments)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a tokenizer (the CLI links it from the model)")
        if isinstance(self._tokenizer, str):
            from aitraining_pl.models import load_tokenizer

            self._tokenizer = load_tokenizer(self._tokenizer)
        return self._tokenizer

    # -- reading and checking
    def _dataset(self, rows: list, source: str) -> Any:
        return rows

    def setup(self, stage: str | None = None) -> None:
        """Read, check and tokenise once (a second call reuses the datasets)."""
        if self.train_dataset is not None:
            return
        hp = self.hparams
        train_source, val = data_sources(hp)
        source = train_source.path if train_source is not None else IN_MEMORY
        records = _read(train_source) if train_source is not None else self._in_memory_records()
        rows = self._rows(records, source)  # check every row before splitting, so row numbers refer to the file
        val_rows, val_source = None, None
        if val is not None:
            val_source = val.path
            val_rows = self._rows(_read(val), val_source)
        elif hp.val_split > 0:
            rows, val_rows = holdout(rows, hp.val_split, hp.seed, source)
            val_source = f"{source} (validation split)"
        train_dataset = self._dataset(rows, source)  # the training set first: its messages come first
        val_dataset = self._dataset(val_rows, val_source) if val_rows is not None else None
        self.train_dataset, self.val_dataset = train_dataset, val_dataset

    # -- loaders
    @property
    def collate_fn(self):
        pad = self.tokenizer.pad_token_id
        return self.collator(pad if pad is not None else 0)

    def _in_order_sampler(self, dataset: Any) -> DistributedSampler | None:
        """Under a distributed trainer, a ``DistributedSampler`` that keeps the rows in order (rank ``r`` of ``n``
        reads rows ``r, r + n, ...``): Lightning would replace the sampler of an unshuffled training loader by a
        shuffling one. None otherwise (Lightning's own sampler, or none, applies)."""
        trainer = self.trainer
        if trainer is None or not getattr(trainer._accelerator_connector, "use_distributed_sampler", True):
            return None
        kwargs = trainer.distributed_sampler_kwargs
        return DistributedSampler(dataset, shuffle=False, **kwargs) if kwargs else None

    def _sharded(self, sampler: Any) -> Any:
        """A sampler's order (a seeded shuffle, ``RankBalancedSampler``'s) dealt to the data-parallel ranks as it is
        (index ``j`` to rank ``j % ranks``; Lightning's ``DistributedSamplerWrapper`` with ``shuffle=False``) under a
        distributed trainer: Lightning's own wrapper would permute it again with its seed, so that one process and
        several ranks (sequence parallelism's single data rank above all) would read the rows in different orders."""
        trainer = self.trainer
        if isinstance(sampler, DistributedSampler) or trainer is None:
            return sampler
        kwargs = trainer.distributed_sampler_kwargs
        if not kwargs or not getattr(trainer._accelerator_connector, "use_distributed_sampler", True):
            return sampler
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

        return DistributedSamplerWrapper(sampler, shuffle=False, **kwargs)

    def _loader(self, dataset: Any, batch_size: int | None = None, **kwargs: Any) -> DataLoader:
        """A loader over ``dataset`` (default batch size: ``eval_batch_size or batch_size``, in order).

        It resumes mid-epoch (``ResumableDataLoader``) and has its own generator, so creating an iterator never
        draws from the global random stream."""
        hp = self.hparams
        batch_size = batch_size or hp.eval_batch_size or hp.batch_size
        kwargs.setdefault("generator", torch.Generator().manual_seed(int(hp.seed)))
        if dataset is getattr(self, "train_dataset", None) and hp.get("balance_ranks") and self._ranks() > 1:
            kwargs = self._rank_balanced(dataset, batch_size, kwargs)
        if "sampler" not in kwargs and not kwargs.get("shuffle"):
            kwargs["sampler"] = self._in_order_sampler(dataset)
        elif kwargs.get("sampler") is not None:
            kwargs["sampler"] = self._sharded(kwargs["sampler"])
        return ResumableDataLoader(
            dataset, batch_size, collate_fn=self.collate_fn, num_workers=hp.num_workers, **kwargs
        )

    def _ranks(self) -> int:
        """Data-parallel processes of the trainer (1 without one)."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return int((kwargs or {}).get("num_replicas", 1))

    def _rank_balanced(self, dataset: Any, batch_size: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``balance_ranks``: the training order (the given sampler, a seeded shuffle or the dataset's order) dealt to
        the ranks with balanced token counts per step (``RankBalancedSampler``)."""
        order = kwargs.pop("sampler", None)
        if order is None:
            order = (
                SeededShuffleSampler(len(dataset), seed=int(self.hparams.seed))
                if kwargs.pop("shuffle", False)
                else range(len(dataset))
            )
        kwargs["sampler"] = RankBalancedSampler(order, dataset.lengths(), batch_size, self._ranks())
        return kwargs

    def val_dataloader(self):
        return self._loader(self.val_dataset) if self.val_dataset is not None else []
