"""Preference pairs (prompt, chosen, rejected): dataset, collator and ``PreferenceDataModule``.

Batch contract (used by DPO and reward-model training): a dict with

- ``input_ids`` (2B, L): the B chosen sequences (prompt + completion + EOS) first, then the B rejected ones;
- ``attention_mask`` (2B, L): 1 on real tokens;
- ``completion_mask`` (2B, L): 1 on completion tokens, including the appended EOS;
- ``index`` (B,): the pair's position in its dataset;
- ``margin`` (B,) float, only when a margin column is configured;

right padded to the longest sequence in the batch (never to ``max_length``).

How a row's prompt and completions are formed (explicit / implicit prompts, standard / conversational rows, the
layouts of UltraFeedback, HH-RLHF and Capybara) follows TRL's rules, listed in ``aitraining_pl.datamodules.formats``;
``encode_pair`` tokenises them as TRL's ``tokenize_row`` does.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from aitraining_pl.datamodules.base import DATA_RANGES, IN_MEMORY
from aitraining_pl.datamodules.cached import CachedDataModule
from aitraining_pl.datamodules.formats import (
    FALLBACK_CHAT_TEMPLATE,
    is_messages,
    preference_texts,
    split_preference,
    template_ends_turns,
)
from aitraining_pl.datamodules.io import DataValidationError, PaddingCollator, check_columns, check_text, pad_sequences
from aitraining_pl.datamodules.resumable import SeededShuffleSampler
from aitraining_pl.datamodules.vision import VISION, vision_pair
from aitraining_pl.models.tokens import with_bos
from aitraining_pl.models.vision import VisionInputs
from aitraining_pl.validation import constructor_arguments, rules

log = logging.getLogger(__name__)

__all__ = ["FALLBACK_CHAT_TEMPLATE", "PreferenceDataset", "PreferenceCollator", "PreferenceDataModule", "encode_pair"]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_pair(
    tokenizer: Any,
    prompt: Any,
    chosen: Any,
    rejected: Any,
    max_length: int,
    max_prompt_length: int,
    encode_prompt: Callable[[str], list[int]] | None = None,
) -> dict[str, Any]:
    """One pair as token ids, after the prompt rules and chat rendering of ``formats`` (``prompt`` ``None``:
    implicit). As TRL's ``tokenize_row``: prompt and completions tokenised separately without special tokens,
    EOS after each completion unless the model's own chat template ended the turn (``formats.template_ends_turns``,
    as TRL 1.x appends EOS to non-conversational rows only), BOS first when the tokenizer adds it itself
    (``models.tokens.adds_bos``, as ``tokenizer(prompt)`` does in TRL) and the text lacks it, the end of the prompt
    kept (``max_prompt_length``), the completions cut to what ``max_length`` leaves. A pair with no prompt and no
    BOS is conditioned on EOS. ``keep`` is false when a completion ends up
    empty; ``identical`` when both completions are the same text. ``encode_prompt`` tokenises the prompt text
    instead of ``tokenizer`` (a VL model's processor with the row's images, ``datamodules.vision``)."""
    parts = split_preference(prompt, chosen, rejected)
    prompt_text, chosen_text, rejected_text = preference_texts(tokenizer, *parts)
    prompt_ids = encode_prompt(prompt_text) if encode_prompt is not None else _ids(tokenizer, prompt_text)
    prompt_ids, eos = with_bos(prompt_ids, tokenizer), tokenizer.eos_token_id
    templated = any(is_messages(part) for part in parts) and template_ends_turns(tokenizer)
    if not prompt_ids and eos is not None:
        # nothing to condition on (no prompt, no BOS): start from EOS, as GPT-2 style models do, so the
        # first completion token is scored instead of the pair being dropped
        prompt_ids = [eos]
    prompt_ids = prompt_ids[-max_prompt_length:]
    room = max_length - len(prompt_ids)
    end = [eos] if eos is not None and not templated else []  # the model's own template ended the turn
    chosen_ids = (_ids(tokenizer, chosen_text) + end)[:room]
    rejected_ids = (_ids(tokenizer, rejected_text) + end)[:room]
    keep = bool(chosen_ids and rejected_ids and prompt_ids)
    return {
        "prompt_ids": prompt_ids,
        "chosen_ids": chosen_ids if keep else [],
        "rejected_ids": rejected_ids if keep else [],
        "keep": keep,
        "identical": chosen_text == rejected_text,
        "length": len(prompt_ids) + max(len(chosen_ids), len(rejected_ids)),
    }


def _column(rows: Any, name: str) -> list:
    """Column ``name`` of a ``datasets.Dataset`` or of a list of dicts."""
    return list(rows[name]) if hasattr(rows, "select") else [r[name] for r in rows]


class PreferenceDataset(Dataset):
    """Tokenised preference pairs, built once (the seed's ``PreferenceDataset`` signature). Prompts and
    completions follow TRL's dataset formats (see ``aitraining_pl.datamodules.formats``).

    Args:
        prompts: prompt per pair: a string or a list of ``{role, content}`` messages; ``None`` to take each
            pair's prompt from the shared start of chosen and rejected (TRL's implicit prompt).
        chosen: preferred completion per pair (string or messages).
        rejected: dispreferred completion per pair (string or messages).
        tokenizer: a Hugging Face tokenizer (chat template used for message lists).
        max_length: longest prompt + completion kept, in tokens.
        max_prompt_length: longest prompt kept, in tokens (the end of the prompt is kept).
        margins: optional per-pair preference margin (floats).
        source: name of the data source used in messages.
    """

    def __init__(
        self,
        prompts: Sequence[Any] | None,
        chosen: Sequence[Any],
        rejected: Sequence[Any],
        tokenizer: Any,
        max_length: int = 512,
        max_prompt_length: int = 256,
        margins: Sequence[float] | None = None,
        source: str = IN_MEMORY,
    ):
        if len(chosen) != len(rejected) or (prompts is not None and len(prompts) != len(chosen)):
            raise DataValidationError(source, "prompts, chosen and rejected must have the same length")
        check_lengths(max_length, max_prompt_length)
        rows = []
        for i in range(len(chosen)):
            prompt = prompts[i] if prompts is not None else None
            row = encode_pair(tokenizer, prompt, chosen[i], rejected[i], max_length, max_prompt_length)
            rows.append(row | {"row": i} | ({"margin": float(margins[i])} if margins is not None else {}))
        self.tokenizer = tokenizer
        self._keep(rows, source, max_length, max_prompt_length)

    @classmethod
    def from_encoded(cls, rows: Any, source: str, max_length: int, max_prompt_length: int) -> PreferenceDataset:
        """A dataset over rows already through ``encode_pair`` (a list or a ``datasets.Dataset``)."""
        self = cls.__new__(cls)
        self._keep(rows, source, max_length, max_prompt_length)
        return self

    def _keep(self, rows: Any, source: str, max_length: int, max_prompt_length: int) -> None:
        """Keep the usable rows, warning once about identical and dropped pairs."""
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        keep, identical = _column(rows, "keep"), sum(_column(rows, "identical"))
        if identical:
            log.warning(
                "%s: %d pair(s) have chosen identical to rejected (they carry no preference signal)", source, identical
            )
        dropped = len(keep) - sum(keep)
        if dropped:
            log.warning(
                "%s: dropped %d of %d pair(s) whose completion was empty after truncation to max_length=%d, "
                "max_prompt_length=%d",
                source,
                dropped,
                len(keep),
                max_length,
                max_prompt_length,
            )
        kept = [i for i, k in enumerate(keep) if k]
        if dropped:
            rows = rows.select(kept) if hasattr(rows, "select") else [rows[i] for i in kept]
        self.examples = rows
        if not kept:
            raise DataValidationError(source, "no usable pairs left after truncation (raise max_length?)")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.examples[index], "index": index}

    def lengths(self) -> list[int]:
        """Longest of the two sequences of each pair (for length-grouped sampling)."""
        return _column(self.examples, "length")


def check_lengths(max_length: int, max_prompt_length: int) -> None:
    if max_prompt_length >= max_length:
        raise ValueError(f"max_prompt_length ({max_prompt_length}) must be < max_length ({max_length})")


class PreferenceCollator(PaddingCollator):
    """Pads a list of pairs into the batch contract (chosen rows first, then rejected, right padded).

    ``PreferenceCollator(pad_token_id)``, as ``PaddingCollator``.
    """

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, completion = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for e in examples:
                sequences.append(e["prompt_ids"] + e[key])
                completion.append([0] * len(e["prompt_ids"]) + [1] * len(e[key]))
        batch = {
            "input_ids": pad_sequences(sequences, self.pad_token_id),
            "attention_mask": pad_sequences([[1] * len(s) for s in sequences], 0),
            "completion_mask": pad_sequences(completion, 0),
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        }
        if "margin" in examples[0]:
            batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float32)
        if examples[0].get(VISION):  # a VL model's pairs: each pair's images serve its chosen and rejected row
            group = torch.arange(len(examples)).repeat(2)
            batch["vision"] = VisionInputs([e[VISION] for e in examples]).for_rows(group)
        return batch


class LengthGroupedSampler(Sampler[int]):
    """Random order in which runs of ``batch_size`` indices have similar lengths, so batches carry little
    padding: shuffle, sort within mega-batches of ``batch_size * group_factor``, shuffle the batches.

    Args:
        lengths: length of each example.
        batch_size: examples per batch.
        seed: base seed; the order changes with ``set_epoch``.
        group_factor: batches per sorted mega-batch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, group_factor: int = 50):
        self.lengths, self.batch_size, self.seed, self.group_factor = list(lengths), batch_size, seed, group_factor
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        mega = self.batch_size * self.group_factor
        batches = []
        for start in range(0, len(order), mega):
            group = sorted(order[start : start + mega], key=lambda i: -self.lengths[i])
            batches += [group[j : j + self.batch_size] for j in range(0, len(group), self.batch_size)]
        # keep the longest batch first (fails fast on memory), shuffle the rest
        first, rest = batches[:1], batches[1:]
        rng.shuffle(rest)
        return iter([i for batch in first + rest for i in batch])


class RowPairsDataModule(CachedDataModule):
    """What the preference and KTO data modules share: rows kept in a ``PreferenceDataset`` (optionally
    length-grouped) and the loaders. A subclass declares its arguments (including ``group_by_length`` and
    ``shuffle``) and encodes its rows."""

    collator = PreferenceCollator

    def _build(self, rows: Any, source: str) -> PreferenceDataset:
        hp = self.hparams
        return PreferenceDataset.from_encoded(rows, source, hp.max_length, hp.max_prompt_length)

    # -- loaders
    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if hp.group_by_length:
            sampler = LengthGroupedSampler(self.train_dataset.lengths(), hp.batch_size, seed=hp.seed)
            return self._loader(self.train_dataset, hp.batch_size, sampler=sampler)
        if hp.shuffle:  # the order of an epoch depends on (seed, epoch) only: a resumed run sees the same
            sampler = SeededShuffleSampler(len(self.train_dataset), seed=hp.seed)
            return self._loader(self.train_dataset, hp.batch_size, sampler=sampler)
        return self._loader(self.train_dataset, hp.batch_size)

    def test_dataloader(self):
        return self.val_dataloader()

    def ordered_dataloaders(self) -> dict[str, DataLoader]:
        """Unshuffled loaders over every split (``train``, ``val``) for one pass such as precomputing
        reference log-probs; batches carry ``index`` into their split."""
        loaders = {"train": self._loader(self.train_dataset)}
        if self.val_dataset is not None:
            loaders["val"] = self._loader(self.val_dataset)
        return loaders


class PreferenceDataModule(RowPairsDataModule):
    """Preference pairs from a file, a hub dataset or in-memory lists, checked before training starts, in any
    of TRL's preference layouts (explicit or implicit prompt, standard or conversational; see
    ``aitraining_pl.datamodules.formats``). File and hub rows are tokenised once into the ``datasets`` cache
    (see ``aitraining_pl.datamodules.cached``).

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file or folder, or a ``datasets`` hub name (or builder
            such as ``json`` with ``data_files``).
        split: split of a hub dataset used for training (e.g. ``train_prefs``; slices such as ``train[:90%]``
            work).
        val_data_path: separate validation file / hub name, read with ``val_split_name`` (default ``split``).
        val_split: fraction of the training rows held out for validation when no validation source is given
            (0 for none).
        name: subset (configuration) of the hub dataset.
        data_files: files of the hub dataset or builder to read (``load_dataset``'s ``data_files``).
        revision: branch, tag or commit of the hub dataset.
        val_split_name: split of ``data_path`` used for validation (e.g. ``test_prefs``); with
            ``val_data_path``, its split.
        prompt_column: column holding the prompt; when the data has no such column, each chosen/rejected
            pair is split at its shared start (TRL's implicit prompt).
        chosen_column: column holding the preferred completion.
        rejected_column: column holding the dispreferred completion.
        margin_column: optional column with a float preference margin (added to batches as ``margin``).
        prompts: in-memory prompts (instead of ``data_path``).
        chosen: in-memory chosen completions.
        rejected: in-memory rejected completions.
        tokenizer: tokenizer object or name (``"byte"``, a folder or hub id); the CLI links it from the model.
        max_length: longest prompt + completion, in tokens.
        max_prompt_length: longest prompt, in tokens (its end is kept).
        batch_size: pairs per training batch.
        eval_batch_size: pairs per validation batch (default: ``batch_size``).
        group_by_length: batch pairs of similar length together (less padding, faster).
        balance_ranks: under data parallelism, deal each step's rows to the ranks with balanced token counts
            (Karmarkar-Karp, ``losses.micro_batches.balance_ranks``) instead of the distributed sampler's strided
            split: no rank waits on one that drew the long rows (with ``token_budget``, docs/long_context.md).
        shuffle: shuffle the training pairs each epoch (off: file order, e.g. for benchmarks).
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and the sampling order.
        max_image_pixels: the largest image accepted (width x height) for a vision-language model (RLAIF-V's
            layout: an ``image`` or ``images`` column); a larger one is refused with its file, row and field.
    """

    argument_ranges = {**DATA_RANGES, **rules("max_length", "max_prompt_length", "max_image_pixels")}

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
        chosen_column: str = "chosen",
        rejected_column: str = "rejected",
        margin_column: str | None = None,
        prompts: list | None = None,
        chosen: list | None = None,
        rejected: list | None = None,
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
        max_image_pixels: int | None = None,
    ):
        super().__init__(tokenizer, (prompts, chosen, rejected))
        self.save_arguments(
            constructor_arguments(
                PreferenceDataModule.__init__, locals(), ignore=("tokenizer", "prompts", "chosen", "rejected")
            )
        )
        self._implicit: dict[str, bool] = {}  # source -> no prompt column

    # -- reading and checking
    def _check_columns(self, rows: Any, source: str) -> None:
        hp = self.hparams
        needed = [hp.chosen_column, hp.rejected_column] + ([hp.margin_column] if hp.margin_column else [])
        check_columns(rows, needed, source)
        implicit = hp.prompt_column not in rows[0]
        if implicit and source not in self._implicit:
            log.warning(
                "%s: no %r column; using the shared prefix of chosen and rejected as the prompt",
                source,
                hp.prompt_column,
            )
        self._implicit[source] = implicit

    def _settings(self) -> dict[str, Any]:
        hp = self.hparams
        keys = ("prompt_column", "chosen_column", "rejected_column", "margin_column", "max_length", "max_prompt_length")
        keys += ("max_image_pixels",)
        return {k: hp[k] for k in keys} | {"fallback_chat_template": FALLBACK_CHAT_TEMPLATE}

    def _encode(self, record: dict, index: int, source: str) -> dict[str, Any]:
        """Check one row (``DataValidationError`` naming row ``index + 1`` and the field) and tokenise it."""
        hp, row = self.hparams, index + 1
        fields = ([] if self._implicit[source] else [hp.prompt_column]) + [hp.chosen_column, hp.rejected_column]
        images = vision_pair(self.tokenizer, record, fields, source, row, hp.max_prompt_length, hp.max_image_pixels)
        if images is not None:  # a VL model: content parts flattened, the prompt's images read (``datamodules.vision``)
            record = {**record, **images.row.values}
        for field in fields:
            if record.get(field) is None:
                raise DataValidationError(source, "missing field", row, field)
            check_text(record[field], source, row, field)
        prompt = None if self._implicit[source] else record[hp.prompt_column]
        encoded = encode_pair(
            self.tokenizer,
            prompt,
            record[hp.chosen_column],
            record[hp.rejected_column],
            hp.max_length,
            hp.max_prompt_length,
            images.encode if images is not None else None,
        ) | {"row": index}
        if images is not None:
            encoded[VISION] = images.vision
        if hp.margin_column:
            value = record.get(hp.margin_column)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataValidationError(source, f"expected a finite number, got {value!r}", row, hp.margin_column)
            encoded["margin"] = float(value)
        return encoded

    def _in_memory_records(self) -> list[dict]:
        hp = self.hparams
        prompts, chosen, rejected = self._in_memory
        if chosen is None or rejected is None:
            raise DataValidationError(IN_MEMORY, "give data_path, or in-memory chosen and rejected lists")
        if len(chosen) != len(rejected) or (prompts is not None and len(prompts) != len(chosen)):
            raise DataValidationError(IN_MEMORY, "prompts, chosen and rejected must have the same length")
        records = [
            {
                hp.chosen_column: c,
                hp.rejected_column: r,
                **({hp.prompt_column: prompts[i]} if prompts is not None else {}),
            }
            for i, (c, r) in enumerate(zip(chosen, rejected))
        ]
        if not records:
            raise DataValidationError(IN_MEMORY, "no rows")
        return records
