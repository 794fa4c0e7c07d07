"""Texts with a vector of target scores, for multi-objective reward models: ``ScoresDataModule``.

Each row holds a text (optionally a prompt, joined in front) and a list of ``num_objectives`` scores; a
``null`` score means "unknown" and is masked out of the loss. Batches are dicts with

- ``input_ids`` (B, L), ``attention_mask`` (B, L): BOS + text + EOS (``encode_for_reward``), right padded
  to the longest row;
- ``targets`` (B, n) float (0 where unknown) and ``objective_mask`` (B, n) bool (True where known).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from aitraining_pl.datamodules.base import DATA_RANGES, IN_MEMORY, TextDataModule
from aitraining_pl.datamodules.io import DataValidationError, check_columns, check_text, pad_sequences
from aitraining_pl.datamodules.resumable import SeededShuffleSampler
from aitraining_pl.models.reward import encode_for_reward
from aitraining_pl.validation import constructor_arguments, rules


def check_scores(value: Any, num_objectives: int, source: str, row: int, field: str) -> list[float | None]:
    """A row's score vector as floats (``None`` for unknown), or a ``DataValidationError`` naming the row."""
    if not isinstance(value, (list, tuple)):
        raise DataValidationError(
            source, f"expected a list of {num_objectives} scores, got {type(value).__name__}", row, field
        )
    if len(value) != num_objectives:
        raise DataValidationError(source, f"expected {num_objectives} scores, got {len(value)}", row, field)
    scores: list[float | None] = []
    for j, score in enumerate(value):
        if score is None or (isinstance(score, float) and math.isnan(score)):
            scores.append(None)
        elif isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise DataValidationError(source, f"score {j} is {score!r}; expected a finite number or null", row, field)
        else:
            scores.append(float(score))
    if all(s is None for s in scores):
        raise DataValidationError(source, "every score is null (the row carries no target)", row, field)
    return scores


class ScoresCollator:
    """Pads examples into the batch described in the module docstring.

    Args:
        pad_token_id: id used for padding (masked out).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [e["input_ids"] for e in examples]
        known = torch.tensor([[s is not None for s in e["scores"]] for e in examples])
        targets = torch.tensor([[0.0 if s is None else s for s in e["scores"]] for e in examples])
        return {
            "input_ids": pad_sequences(ids, self.pad_token_id),
            "attention_mask": pad_sequences([[1] * len(x) for x in ids], 0),
            "targets": targets,
            "objective_mask": known,
        }


class ScoresDataModule(TextDataModule):
    """Texts with per-objective target scores, from a file, a hub dataset or in-memory lists, all rows
    checked before training starts.

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file, or a ``datasets`` hub name.
        num_objectives: length of every score vector.
        split: split to load when ``data_path`` is a hub name.
        val_data_path: separate validation file / hub name (its ``test`` split when it equals ``data_path``;
            else ``val_split`` of the training rows).
        val_split: fraction of the training rows held out for validation (0 for none).
        text_column: column with the text to score (the response, or the whole conversation).
        prompt_column: optional column put in front of the text.
        scores_column: column with the list of scores (``null`` = unknown, masked).
        texts: in-memory texts (instead of ``data_path``).
        scores: in-memory score vectors.
        tokenizer: tokenizer object or name (``"byte"``, a folder or hub id); the CLI links it from the model.
        max_length: longest sequence kept, in tokens (its end is kept).
        batch_size: rows per training batch.
        eval_batch_size: rows per validation batch (default: ``batch_size``).
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and the shuffling.
    """

    collator = ScoresCollator

    argument_ranges = {**DATA_RANGES, **rules("max_length", "num_objectives")}

    def __init__(
        self,
        data_path: str | None = None,
        num_objectives: int = 1,
        split: str = "train",
        val_data_path: str | None = None,
        val_split: float = 0.1,
        text_column: str = "text",
        prompt_column: str | None = None,
        scores_column: str = "scores",
        texts: list | None = None,
        scores: list | None = None,
        tokenizer: Any = None,
        max_length: int = 512,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(tokenizer, (texts, scores))
        self.save_arguments(
            constructor_arguments(ScoresDataModule.__init__, locals(), ignore=("tokenizer", "texts", "scores"))
        )

    def _in_memory_records(self) -> list[dict]:
        hp = self.hparams
        texts, scores = self._in_memory
        if texts is None or scores is None or len(texts) != len(scores) or not texts:
            raise DataValidationError(
                IN_MEMORY, "give data_path, or non-empty in-memory texts and scores of equal length"
            )
        return [{hp.text_column: t, hp.scores_column: s} for t, s in zip(texts, scores)]

    def _rows(self, records: list[dict], source: str) -> list[dict]:
        """Check every row (text, optional prompt, score vector) and tokenise it."""
        hp = self.hparams
        fields = ([hp.prompt_column] if hp.prompt_column else []) + [hp.text_column]
        check_columns(records, fields + [hp.scores_column], source)
        examples = []
        for row, record in enumerate(records, start=1):
            for field in fields + [hp.scores_column]:
                if field not in record:
                    raise DataValidationError(source, "missing field", row, field)
            for field in fields:
                check_text(record[field], source, row, field, allow_messages=False)
            scores = check_scores(record[hp.scores_column], hp.num_objectives, source, row, hp.scores_column)
            text = "".join(record[f] for f in fields)
            examples.append({"input_ids": encode_for_reward(self.tokenizer, text, hp.max_length), "scores": scores})
        return examples

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        sampler = SeededShuffleSampler(len(self.train_dataset), seed=hp.seed)  # resumable order
        return self._loader(self.train_dataset, hp.batch_size, sampler=sampler)
