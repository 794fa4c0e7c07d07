"""Prompts for on-policy training (PPO): dataset, collator and ``PromptDataModule``.

Batch contract (used by ``PPOModule``): a dict with

- ``input_ids`` (B, P): prompt tokens, LEFT padded (generation appends on the right);
- ``attention_mask`` (B, P): 1 on real tokens;
- ``prompts``: list of B prompt texts (after the chat template), passed to the reward source;
- ``metadata``: list of B dicts, the row's extra columns (e.g. a math problem's answer), passed to the
  reward source.

Prompts follow TRL's prompt-only type (``aitraining_pl.datamodules.formats.prompt_text``): strings as they are,
messages through the chat template with the generation prompt (or left open when the last turn is the assistant's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset

from aitraining_pl.datamodules.base import DATA_RANGES, IN_MEMORY
from aitraining_pl.datamodules.cached import CachedDataModule
from aitraining_pl.datamodules.formats import FALLBACK_CHAT_TEMPLATE, prompt_text
from aitraining_pl.datamodules.io import DataValidationError, PaddingCollator, check_columns, check_text, pad_sequences
from aitraining_pl.datamodules.resumable import SeededShuffleSampler
from aitraining_pl.datamodules.vision import (
    IMAGE_COLUMNS,
    IMAGES,
    VISION,
    RowImages,
    collate_vision,
    encode_with_images,
    vision_processor,
)
from aitraining_pl.models.tokens import with_bos
from aitraining_pl.validation import constructor_arguments, rules

log = logging.getLogger(__name__)

#: Columns an encoded row adds: the rendered prompt and its token ids.
TEXT, IDS = "__prompt_text", "__input_ids"


def encode_prompt(tokenizer: Any, prompt: Any, max_prompt_length: int, use_chat_template: bool) -> dict[str, Any]:
    """A prompt as ``{TEXT: rendered text, IDS: token ids}``: TRL's prompt-only type (``formats.prompt_text``),
    tokenised without special tokens, BOS first when the tokenizer has one, the end kept."""
    text = prompt_text(tokenizer, prompt, use_chat_template)
    ids = with_bos(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer)
    return {TEXT: text, IDS: ids[-max_prompt_length:]}


def encode_vision_prompt(processor, record: dict, column: str, max_prompt_length: int, use_chat_template: bool,
                         source: str, row: int, max_image_pixels: int | None) -> dict[str, Any]:  # fmt: skip
    """A prompt row with its images as ``{TEXT, IDS, VISION, IMAGES}`` (``encode_prompt``'s fields,
    the vision inputs and the images as read, for vLLM, which encodes them itself); a prompt longer than
    ``max_prompt_length`` with its image tokens is refused (cutting it would cut images)."""
    found = RowImages(processor, record, [column], source, row, max_image_pixels)
    prompt = found.values[column]
    check_text(prompt, source, row, column)
    text = prompt_text(processor.tokenizer, prompt, use_chat_template)
    ids, vision = encode_with_images(processor, text, found.images)
    ids = with_bos(ids, processor.tokenizer)
    if len(ids) > max_prompt_length:
        message = f"{len(ids)} prompt tokens with its image tokens: more than max_prompt_length={max_prompt_length}"
        raise DataValidationError(source, f"{message} (an image cannot be cut)", row, column)
    return {TEXT: text, IDS: ids, VISION: vision, IMAGES: found.images}


class PromptDataset(Dataset):
    """Tokenised prompts with per-row metadata, built once.

    Args:
        prompts: one string or list of ``{role, content}`` messages per row.
        tokenizer: a Hugging Face tokenizer.
        metadata: optional dict per row, handed to the reward source.
        max_prompt_length: longest prompt kept, in tokens (the end of the prompt is kept).
        use_chat_template: render string prompts as a user message through the chat template (message
            lists always are).
    """

    def __init__(
        self,
        prompts: Sequence[Any],
        tokenizer: Any,
        metadata: Sequence[dict] | None = None,
        max_prompt_length: int = 256,
        use_chat_template: bool = False,
    ):
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"{len(metadata)} metadata rows for {len(prompts)} prompts")
        self.tokenizer = tokenizer
        rows = [
            {
                **(dict(metadata[i]) if metadata is not None else {}),
                **encode_prompt(tokenizer, prompt, max_prompt_length, use_chat_template),
            }
            for i, prompt in enumerate(prompts)
        ]
        self._init(rows, exclude=())

    @classmethod
    def from_encoded(cls, rows: Any, exclude: Sequence[str] = (), keep: Sequence[str] | None = None) -> PromptDataset:
        """A dataset over rows already through ``encode_prompt`` (a list or a ``datasets.Dataset``); metadata
        is every other column except ``exclude`` (only ``keep`` when given)."""
        self = cls.__new__(cls)
        self._init(rows, exclude, keep)
        return self

    def _init(self, rows: Any, exclude: Sequence[str], keep: Sequence[str] | None = None) -> None:
        self.examples, self._exclude, self._keep = rows, set(exclude) | {TEXT, IDS}, keep

    def _metadata(self, row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in self._exclude and (self._keep is None or k in self._keep)}

    @property
    def texts(self) -> list[str]:
        """The rendered prompts."""
        return list(self.examples[TEXT]) if hasattr(self.examples, "select") else [r[TEXT] for r in self.examples]

    @property
    def metadata(self) -> list[dict]:
        """Each row's metadata."""
        return [self._metadata(row) for row in self.examples]

    @property
    def input_ids(self) -> list[list[int]]:
        """Each prompt's token ids."""
        return list(self.examples[IDS]) if hasattr(self.examples, "select") else [r[IDS] for r in self.examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.examples[index]
        item = {"input_ids": row[IDS], "prompt": row[TEXT], "metadata": self._metadata(row)}
        if row.get(VISION):  # a VL model's row with images (``datamodules.vision``)
            item["vision"] = row[VISION]
            if row.get(IMAGES) is not None:
                item["images"] = row[IMAGES]
        return item


class PromptCollator(PaddingCollator):
    """Left-pads prompts into the batch contract. ``PromptCollator(pad_token_id)``, as ``PaddingCollator``."""

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        ids = [e["input_ids"] for e in examples]
        return {
            "input_ids": pad_sequences(ids, self.pad_token_id, side="left"),
            "attention_mask": pad_sequences([[1] * len(i) for i in ids], 0, side="left"),
            "prompts": [e["prompt"] for e in examples],
            "metadata": [e["metadata"] for e in examples],
            **({"vision": collate_vision(examples)} if any("vision" in e for e in examples) else {}),
        }


class PromptDataModule(CachedDataModule):
    """Prompts from a file, a hub dataset or an in-memory list, checked before training starts (TRL's
    prompt-only type: a string, or messages rendered with the generation prompt). File and hub rows are
    tokenised once into the ``datasets`` cache (see ``aitraining_pl.datamodules.cached``).

    Training batches have a fixed size (the last incomplete batch is dropped), so every rank runs the same
    number of PPO minibatches.

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file or folder, or a ``datasets`` hub name (or builder
            such as ``json`` with ``data_files``).
        split: split of a hub dataset used for training (slices such as ``train[:90%]`` work).
        val_data_path: separate validation prompts (file or hub name), read with ``val_split_name`` (default
            ``split``); else ``val_split`` of the rows.
        val_split: fraction of the rows held out for validation when no validation source is given (0 for none).
        name: subset (configuration) of the hub dataset.
        data_files: files of the hub dataset or builder to read (``load_dataset``'s ``data_files``).
        revision: branch, tag or commit of the hub dataset.
        val_split_name: split of ``data_path`` used for validation (e.g. ``test``); with ``val_data_path``,
            its split.
        prompt_column: column holding the prompt (a string or chat messages).
        metadata_columns: columns passed to the reward source as per-row metadata (default: every other
            column); each must be present (not null) in every row.
        prompts: in-memory prompts (instead of ``data_path``).
        metadata: in-memory metadata, one dict per prompt.
        tokenizer: tokenizer object or name (``"byte"``, a folder or hub id); the CLI links it from the model.
        use_chat_template: render string prompts through the tokenizer's chat template as a user turn.
        max_prompt_length: longest prompt, in tokens (its end is kept; a prompt with images is refused instead).
        batch_size: prompts per PPO iteration (per device); the seed's ``batch_size``.
        eval_batch_size: prompts per validation batch (default: ``batch_size``).
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and of the prompt order.
        max_image_pixels: the largest image accepted (width x height) for a vision-language model; a larger one is
            refused with its file, row and field (None: any size; the processor resizes what it takes).
    """

    collator = PromptCollator
    keep_columns = True  # the other columns are the metadata

    argument_ranges = {**DATA_RANGES, **rules("max_prompt_length", "max_image_pixels")}

    def __init__(
        self,
        data_path: str | None = None,
        split: str = "train",
        val_data_path: str | None = None,
        val_split: float = 0.0,
        name: str | None = None,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        revision: str | None = None,
        val_split_name: str | None = None,
        prompt_column: str = "prompt",
        metadata_columns: list[str] | None = None,
        prompts: list | None = None,
        metadata: list[dict] | None = None,
        tokenizer: Any = None,
        use_chat_template: bool = False,
        max_prompt_length: int = 256,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        max_image_pixels: int | None = None,
    ):
        super().__init__(tokenizer, (prompts, metadata))
        self.save_arguments(
            constructor_arguments(PromptDataModule.__init__, locals(), ignore=("tokenizer", "prompts", "metadata"))
        )

    @property
    def tokenizer(self):
        if self._tokenizer is None and self.trainer is not None and hasattr(self.trainer.lightning_module, "tokenizer"):
            self._tokenizer = self.trainer.lightning_module.tokenizer
        return super().tokenizer

    # -- reading and checking
    def _in_memory_records(self) -> list[dict]:
        prompts, metadata = self._in_memory
        if prompts is None:
            raise DataValidationError(IN_MEMORY, "give data_path or an in-memory list of prompts")
        if metadata is not None and len(metadata) != len(prompts):
            raise DataValidationError(IN_MEMORY, f"{len(metadata)} metadata rows for {len(prompts)} prompts")
        records = []
        for i, prompt in enumerate(prompts):
            meta = metadata[i] if metadata is not None else {}
            if not isinstance(meta, dict):
                raise DataValidationError(
                    IN_MEMORY, f"metadata must be a dict, got {type(meta).__name__}", i + 1, "metadata"
                )
            records.append({**meta, self.hparams.prompt_column: prompt})
        if not records:
            raise DataValidationError(IN_MEMORY, "no rows")
        return records

    def _check_columns(self, rows: Any, source: str) -> None:
        hp = self.hparams
        check_columns(rows, [hp.prompt_column] + list(hp.metadata_columns or []), source)

    def _settings(self) -> dict[str, Any]:
        hp = self.hparams
        keys = ("prompt_column", "metadata_columns", "use_chat_template", "max_prompt_length", "max_image_pixels")
        return {k: hp[k] for k in keys} | {"fallback_chat_template": FALLBACK_CHAT_TEMPLATE}

    def _encode(self, record: dict, index: int, source: str) -> dict[str, Any]:
        """Check one row (``DataValidationError`` naming row ``index + 1`` and the field) and tokenise it."""
        hp, row = self.hparams, index + 1
        if record.get(hp.prompt_column) is None:
            raise DataValidationError(source, "missing field", row, hp.prompt_column)
        processor = vision_processor(self.tokenizer)
        if processor is not None:  # a VL model: the row's images through its processor (``datamodules.vision``)
            return encode_vision_prompt(processor, record, hp.prompt_column, hp.max_prompt_length,
                                        hp.use_chat_template, source, row, hp.max_image_pixels)  # fmt: skip
        check_text(record[hp.prompt_column], source, row, hp.prompt_column)
        for column in hp.metadata_columns or []:
            if record.get(column) is None:
                raise DataValidationError(source, "missing field", row, column)
        return encode_prompt(self.tokenizer, record[hp.prompt_column], hp.max_prompt_length, hp.use_chat_template)

    def _build(self, rows: Any, source: str) -> PromptDataset:
        hp = self.hparams
        exclude = [hp.prompt_column, VISION, IMAGES, *IMAGE_COLUMNS]
        return PromptDataset.from_encoded(rows, exclude=exclude, keep=hp.metadata_columns)

    def setup(self, stage: str | None = None) -> None:
        """Read, check and tokenise once (a second call reuses the datasets)."""
        super().setup(stage)
        hp, n = self.hparams, len(self.train_dataset)
        if n < hp.batch_size:
            source = hp.data_path if hp.data_path is not None else IN_MEMORY
            raise DataValidationError(source, f"{n} training prompt(s) is fewer than batch_size={hp.batch_size}")

    def train_dataloader(self) -> DataLoader:
        sampler = SeededShuffleSampler(len(self.train_dataset), seed=self.hparams.seed)  # resumable order
        return self._loader(self.train_dataset, self.hparams.batch_size, sampler=sampler, drop_last=True)

    def sample_prompts(self, n: int) -> tuple[list[str], list[dict]]:
        """The first ``n`` prompts (validation prompts when there are some) and their metadata, e.g. for
        ``SamplingCallback``."""
        self.setup()
        dataset = self.val_dataset or self.train_dataset
        rows = [dataset[i] for i in range(min(n, len(dataset)))]
        return [r["prompt"] for r in rows], [r["metadata"] for r in rows]
