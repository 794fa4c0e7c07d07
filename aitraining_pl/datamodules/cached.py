"""``CachedDataModule``: rows checked and tokenised once, through ``datasets``, and reused by later runs.

A file or hub source is read as an Arrow-backed ``datasets.Dataset`` and encoded with ``Dataset.map`` under a
fingerprint of (the data, the tokenizer, the module's encoding settings, ``ENCODING_VERSION``), so ``datasets``
writes the result beside its cache of the data and a second run (or another rank) loads it instead of
tokenising again. Lightning runs ``prepare_data`` on local rank 0 only and every rank's ``setup`` after a
barrier: the encoding happens there once and the other ranks read the cache.
"""

from __future__ import annotations

import logging
from typing import Any

from aitraining_pl.datamodules.base import IN_MEMORY, TextDataModule, holdout_indices
from aitraining_pl.datamodules.io import DataSource, data_sources, load_source, quiet_datasets
from aitraining_pl.models.vision import processor_of

log = logging.getLogger(__name__)

#: Bumped whenever an ``_encode`` rule changes, so caches written by older code are not reused.
ENCODING_VERSION = 3  # 3: BOS only when the tokenizer adds it, no EOS after a chat template

#: Row count from which tokenising shows a progress bar.
PROGRESS_ROWS = 10_000


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's full state (vocabulary, special tokens, chat template), stable across processes."""
    from datasets.fingerprint import Hasher

    try:
        return Hasher.hash(tokenizer)
    except Exception:  # an unpicklable tokenizer: its class, name and vocabulary
        vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else None
        return Hasher.hash(
            [
                type(tokenizer).__qualname__,
                getattr(tokenizer, "name_or_path", None),
                vocab,
                getattr(tokenizer, "chat_template", None),
            ]
        )


def take(rows: Any, indices: list[int]) -> Any:
    """The ``indices`` of a ``datasets.Dataset`` (``select``) or of a list."""
    return rows.select(indices) if hasattr(rows, "select") else [rows[i] for i in indices]


class CachedDataModule(TextDataModule):
    """Base of the data modules whose rows are checked and tokenised one at a time. A subclass provides
    ``_in_memory_records()``, ``_check_columns(rows, source)``, ``_encode(record, index, source) -> dict`` (raise
    ``DataValidationError`` naming ``index + 1`` as the row), ``_settings()`` (everything besides the tokenizer
    that changes ``_encode``'s output) and ``_build(encoded_rows, source)`` (the torch dataset). With
    ``keep_columns`` the encoded fields are added to the row's columns, else they replace them.
    """

    keep_columns = False

    def _data_sources(self) -> tuple[DataSource | None, DataSource | None]:
        """``data_sources`` of the hyperparameters, resolved (and any deprecation announced) once."""
        if getattr(self, "_sources", None) is None:
            self._sources = data_sources(self.hparams)
        return self._sources

    def _fingerprint(self, rows: Any) -> str:
        from datasets.fingerprint import Hasher

        tokenizer = self.tokenizer
        if getattr(self, "_tokenizer_hash", (None, None))[0] is not tokenizer:
            self._tokenizer_hash = (tokenizer, tokenizer_fingerprint(tokenizer))
        return Hasher.hash(
            [rows._fingerprint, self._tokenizer_hash[1], self._settings(), type(self).__qualname__, ENCODING_VERSION]
        )

    def _encode_rows(self, rows: Any, source: str) -> Any:
        """``_encode`` over every row: a cached ``Dataset.map`` for a ``Dataset``, a loop for a list."""
        self._check_columns(rows, source)
        if processor_of(self.tokenizer) is not None and not isinstance(rows, list):
            rows = rows.to_list()  # rows with images stay in memory (not cached: PIL images, tensors)
        if isinstance(rows, list):
            return [({**r} if self.keep_columns else {}) | self._encode(r, i, source) for i, r in enumerate(rows)]
        with quiet_datasets(progress=len(rows) >= PROGRESS_ROWS):
            return rows.map(
                lambda record, index: self._encode(record, index, source),
                with_indices=True,
                remove_columns=None if self.keep_columns else rows.column_names,
                new_fingerprint=self._fingerprint(rows),
                desc=f"Tokenising {source}",
            )

    def _encoded(self, source: DataSource) -> Any:
        return self._encode_rows(load_source(source), source.label)

    def prepare_data(self) -> None:
        """Read and tokenise every file / hub source into the ``datasets`` cache (Lightning calls this on local
        rank 0 only, before ``setup`` on every rank)."""
        for source in self._data_sources():
            rows = load_source(source) if source is not None else None
            if rows is not None and not isinstance(rows, list):  # a list is not cached: setup reads it
                self._encode_rows(rows, source.label)

    def setup(self, stage: str | None = None) -> None:
        """Read, check and tokenise once (a second call reuses the datasets; cached rows are loaded)."""
        if self.train_dataset is not None:
            return
        hp = self.hparams
        train_source, val_source = self._data_sources()
        source = train_source.label if train_source is not None else IN_MEMORY
        if train_source is not None:
            rows = self._encoded(train_source)
        else:
            rows = self._encode_rows(self._in_memory_records(), IN_MEMORY)
        val_rows, val_name = None, None
        if val_source is not None:
            val_rows, val_name = self._encoded(val_source), val_source.label
        elif hp.val_split > 0:  # split after checking every row, so row numbers refer to the file
            train_idx, val_idx = holdout_indices(len(rows), hp.val_split, hp.seed, source)
            rows, val_rows, val_name = take(rows, train_idx), take(rows, val_idx), f"{source} (validation split)"
        train_dataset = self._build(rows, source)  # the training set first: its messages come first
        val_dataset = self._build(val_rows, val_name) if val_rows is not None else None
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
