"""Unpaired preference data (``prompt``, ``completion``, ``label``): ``KTODataModule`` and its collator.

TRL's unpaired preference layout: each row is one completion with a boolean label, ``true`` for desirable
(thumbs up) and ``false`` for undesirable. Rows are tokenised as one side of a preference pair
(``preference.encode_pair``: the same prompt rules, chat rendering, truncation and EOS).

Batch contract (``KTOModule``), following the preference contract so the same scoring and packing apply:

- ``input_ids``, ``attention_mask``, ``completion_mask`` (2B, L): the B rows, then B *mismatched* rows, row
  ``B + i`` holding prompt ``i`` with the completion of row ``i - 1`` of the batch (cyclically; cut to
  ``max_length``). KTO estimates its reference point from these (Ethayarajh et al. 2024, sec. 4.1; TRL's KL
  completions). Row ``B + i`` shares row ``i``'s prompt, so ``share_prompt`` packs each as one sequence;
- ``label`` (B,) bool: desirable; ``index`` (B,): the row's position in its dataset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from aitraining_pl.datamodules.base import DATA_RANGES, IN_MEMORY
from aitraining_pl.datamodules.formats import FALLBACK_CHAT_TEMPLATE
from aitraining_pl.datamodules.io import DataValidationError, check_columns, check_text, pad_sequences
from aitraining_pl.datamodules.preference import RowPairsDataModule, encode_pair
from aitraining_pl.validation import Range, constructor_arguments, rules


class KTOCollator:
    """Pads unpaired rows and their mismatched partners into the KTO batch contract (module docstring).

    Args:
        pad_token_id: id used for padding (masked out everywhere).
        max_length: longest prompt + completion of a mismatched row (its completion is cut to fit).
    """

    def __init__(self, pad_token_id: int, max_length: int):
        self.pad_token_id, self.max_length = pad_token_id, max_length

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = len(examples)
        rows = [(e["prompt_ids"], e["completion_ids"]) for e in examples]
        for i, e in enumerate(examples):  # prompt i with the completion of row i - 1 (row 0: the last row)
            rows.append(
                (e["prompt_ids"], examples[(i - 1) % n]["completion_ids"][: self.max_length - len(e["prompt_ids"])])
            )
        return {
            "input_ids": pad_sequences([p + c for p, c in rows], self.pad_token_id),
            "attention_mask": pad_sequences([[1] * (len(p) + len(c)) for p, c in rows], 0),
            "completion_mask": pad_sequences([[0] * len(p) + [1] * len(c) for p, c in rows], 0),
            "label": torch.tensor([bool(e["label"]) for e in examples]),
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        }


#: KTO's reference point pairs rows of the same batch: a batch holds at least two rows.
PAIRED_BATCH = Range(2, integer=True, reason="KTO's reference point pairs rows of the same batch")


class KTODataModule(RowPairsDataModule):
    """Unpaired completions labelled desirable / undesirable, from a file, a hub dataset or in-memory lists,
    checked before training starts (a bad row raises an error naming the file, row and field).

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file or folder, or a ``datasets`` hub name (or builder
            such as ``json`` with ``data_files``).
        split: split of a hub dataset used for training.
        val_data_path: separate validation file / hub name, read with ``val_split_name`` (default ``split``).
        val_split: fraction of the training rows held out for validation when no validation source is given
            (0 for none).
        name: subset (configuration) of the hub dataset.
        data_files: files of the hub dataset or builder to read (``load_dataset``'s ``data_files``).
        revision: branch, tag or commit of the hub dataset.
        val_split_name: split of ``data_path`` used for validation; with ``val_data_path``, its split.
        prompt_column: column holding the prompt (a string or messages).
        completion_column: column holding the completion (a string or messages).
        label_column: column holding the label, ``true`` (desirable) or ``false`` (undesirable).
        prompts: in-memory prompts (instead of ``data_path``).
        completions: in-memory completions.
        labels: in-memory labels (booleans).
        tokenizer: tokenizer object or name (``"byte"``, a folder or hub id); the CLI links it from the model.
        max_length: longest prompt + completion, in tokens.
        max_prompt_length: longest prompt, in tokens (its end is kept).
        batch_size: rows per training batch (at least 2: the mismatched rows come from the same batch).
        eval_batch_size: rows per validation batch (default: ``batch_size``; at least 2).
        group_by_length: batch rows of similar length together (less padding, faster).
        balance_ranks: under data parallelism, deal each step's rows to the ranks with balanced token counts
            (Karmarkar-Karp, ``losses.micro_batches.balance_ranks``) instead of the distributed sampler's strided
            split: no rank waits on one that drew the long rows (with ``token_budget``, docs/long_context.md).
        shuffle: shuffle the training rows each epoch.
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and the sampling order.
    """

    argument_ranges = {
        **DATA_RANGES,
        **rules("max_length", "max_prompt_length"),
        "batch_size": PAIRED_BATCH,
        "eval_batch_size": dataclasses.replace(PAIRED_BATCH, optional=True),
    }

    def __init__(
        self,
        data_path: str | None = None,
        split: str = "train",
        val_data_path: str | None = None,
        val_split: float = 0.1,
        name: str | None = None,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        revision: str | None = None,
        val_split_name: str | None = None,
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        label_column: str = "label",
        prompts: list | None = None,
        completions: list | None = None,
        labels: list[bool] | None = None,
        tokenizer: Any = None,
        max_length: int = 512,
        max_prompt_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        group_by_length: bool = False,
        balance_ranks: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(tokenizer, (prompts, completions, labels))
        self.save_arguments(
            constructor_arguments(
                KTODataModule.__init__, locals(), ignore=("tokenizer", "prompts", "completions", "labels")
            )
        )

    @property
    def collate_fn(self):
        pad = self.tokenizer.pad_token_id
        return KTOCollator(pad if pad is not None else 0, self.hparams.max_length)

    def _check_columns(self, rows: Any, source: str) -> None:
        hp = self.hparams
        check_columns(rows, [hp.prompt_column, hp.completion_column, hp.label_column], source)

    def _settings(self) -> dict[str, Any]:
        hp = self.hparams
        keys = ("prompt_column", "completion_column", "label_column", "max_length", "max_prompt_length")
        return {k: hp[k] for k in keys} | {"fallback_chat_template": FALLBACK_CHAT_TEMPLATE}

    def _encode(self, record: dict, index: int, source: str) -> dict[str, Any]:
        """Check one row (``DataValidationError`` naming row ``index + 1`` and the field) and tokenise it."""
        hp, row = self.hparams, index + 1
        for field in (hp.prompt_column, hp.completion_column):
            if record.get(field) is None:
                raise DataValidationError(source, "missing field", row, field)
            check_text(record[field], source, row, field)
        label = record.get(hp.label_column)
        if not isinstance(label, bool):
            raise DataValidationError(source, f"expected true or false, got {label!r}", row, hp.label_column)
        prompt, completion = record[hp.prompt_column], record[hp.completion_column]
        pair = encode_pair(self.tokenizer, prompt, completion, completion, hp.max_length, hp.max_prompt_length)
        return {
            "prompt_ids": pair["prompt_ids"],
            "completion_ids": pair["chosen_ids"],
            "label": label,
            "keep": pair["keep"],
            "identical": False,
            "length": pair["length"],
            "row": index,
        }

    def _in_memory_records(self) -> list[dict]:
        hp = self.hparams
        prompts, completions, labels = self._in_memory
        if prompts is None or completions is None or labels is None:
            raise DataValidationError(IN_MEMORY, "give data_path, or in-memory prompts, completions and labels")
        if not len(prompts) == len(completions) == len(labels):
            raise DataValidationError(IN_MEMORY, "prompts, completions and labels must have the same length")
        if not prompts:
            raise DataValidationError(IN_MEMORY, "no rows")
        return [
            {hp.prompt_column: p, hp.completion_column: c, hp.label_column: lab}
            for p, c, lab in zip(prompts, completions, labels)
        ]

    def ordered_dataloaders(self):
        raise NotImplementedError("KTO's mismatched rows depend on the batch: its reference is never precomputed")
