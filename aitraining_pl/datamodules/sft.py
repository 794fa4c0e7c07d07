"""Supervised fine-tuning data: dataset, collator and ``SFTDataModule``, in TRL's SFT layouts.

A row is one of (the layout is read from the columns of the first row, in this order):

- **conversational**: ``messages``, a list of ``{role, content}`` dicts, rendered with the tokenizer's chat
  template (``FALLBACK_CHAT_TEMPLATE`` when it has none);
- **prompt-completion**: ``prompt`` and ``completion``, each a string or a list of messages (with messages
  the pair is rendered with the chat template, the prompt ending in the assistant header);
- **plain text** (language modelling): ``text``.

Batch contract (used by ``SFTModule``): a dict with

- ``input_ids`` (B, L): the sequences (BOS when the tokenizer adds it itself, the text, EOS unless the model's own
  chat template ended the turn: TRL's tokenization), right padded;
- ``attention_mask`` (B, L): 1 on real tokens;
- ``completion_mask`` (B, L): 1 on the tokens the loss is on (see ``SFTDataset``);
- ``index`` (B,): the row's position in its dataset.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from aitraining_pl.datamodules.base import DATA_RANGES, IN_MEMORY, TextDataModule
from aitraining_pl.datamodules.formats import is_messages, template_ends_turns
from aitraining_pl.datamodules.io import DataValidationError, PaddingCollator, check_columns, check_text, pad_sequences
from aitraining_pl.datamodules.preference import FALLBACK_CHAT_TEMPLATE, LengthGroupedSampler
from aitraining_pl.datamodules.vision import (
    IMAGES,
    VISION,
    RowImages,
    encode_pieces,
    image_placeholder,
    merged_vision,
    vision_processor,
)
from aitraining_pl.models.tokens import adds_bos
from aitraining_pl.models.vision import VisionInputs
from aitraining_pl.validation import constructor_arguments, rules

log = logging.getLogger(__name__)

#: (text, scored) pieces of one rendered row, tokenised piece by piece.
Segments = list[tuple[str, bool]]


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template
    )


def assistant_segments(tokenizer: Any, messages: list[dict]) -> Segments:
    """The rendered conversation cut into pieces, each assistant turn a scored piece.

    An assistant turn is the text that the message adds to the conversation rendered up to its generation
    prompt (its content and the template's end-of-turn markup). A turn is located when that rendering is
    consistent (the conversation up to the turn's generation prompt, extended by the turn, is a prefix of
    the whole); turns a template renders differently in the middle of a conversation (e.g. templates that
    drop earlier reasoning) are left unscored. Returns ``[]`` when no assistant turn is located.
    """
    full, segments, done = _render(tokenizer, messages), [], 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1])
        if len(before) >= done and through.startswith(before) and full.startswith(through):
            segments += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
            done = len(through)
    if not segments:
        return []
    return segments + [(full[done:], False)]


def prompt_completion_segments(tokenizer: Any, prompt: Any, completion: Any) -> Segments:
    """``[(prompt text, False), (completion text, True)]``; message lists go through the chat template (the
    prompt with its generation prompt; a string prompt or completion becomes a user / assistant message)."""
    if not (is_messages(prompt) or is_messages(completion)):
        return [(prompt, False), (completion, True)]
    prompt = prompt if is_messages(prompt) else [{"role": "user", "content": prompt}]
    completion = completion if is_messages(completion) else [{"role": "assistant", "content": completion}]
    full = _render(tokenizer, prompt + completion)
    head = _render(tokenizer, prompt, generation_prompt=True)
    if not full.startswith(head):  # a template whose generation prompt is not a prefix of the answer
        head = _render(tokenizer, prompt)
    return [(head, False), (full[len(head) :], True)]


class SFTDataset(Dataset):
    """Tokenised SFT rows, built once. Each row: BOS (when the tokenizer adds it itself: ``models.tokens.adds_bos``),
    its pieces tokenised one by one (so the boundary of a completion is a token boundary), EOS (unless the text
    already ends with it, or the model's own chat template rendered the row: ``formats.template_ends_turns``), the
    first ``max_length`` tokens kept.

    The loss (``completion_mask``) with ``completion_only_loss`` is on: the completion and its EOS
    (prompt-completion); every assistant turn located by ``assistant_segments`` with its end-of-turn markup, and
    the EOS after a final assistant turn under the fallback template (conversational); every token (plain text).
    Without it, on every token.

    Args:
        records: rows in one of the layouts (see the module docstring).
        layout: ``"messages"``, ``"prompt_completion"`` or ``"text"``.
        columns: column name per field (``messages``, ``prompt``, ``completion``, ``text``).
        tokenizer: a Hugging Face tokenizer.
        max_length: longest sequence kept, in tokens (the start is kept).
        completion_only_loss: loss on completions / assistant turns only (else on all tokens).
        source: name of the data source used in messages.
    """

    def __init__(
        self,
        records: Sequence[dict],
        layout: str,
        columns: dict[str, str],
        tokenizer: Any,
        max_length: int = 1024,
        completion_only_loss: bool = True,
        source: str = IN_MEMORY,
    ):
        self.tokenizer, self.max_length, self.completion_only_loss = tokenizer, max_length, completion_only_loss
        self.examples: list[dict[str, Any]] = []
        dropped = 0
        for row, record in enumerate(records, start=1):
            segments = self._segments(record, layout, columns, source, row)
            field = columns["prompt" if layout == "prompt_completion" else layout]
            fields = {"messages": ("messages",), "prompt_completion": ("prompt", "completion")}.get(layout, ())
            templated = any(is_messages(record[columns[f]]) for f in fields) and template_ends_turns(tokenizer)
            example = self._tokenize(segments, record.get(IMAGES) or [], (source, row, field), not templated)
            if example is None:
                dropped += 1
                continue
            self.examples.append({**example, "row": row - 1})
        if dropped:
            log.warning(
                "%s: dropped %d of %d row(s) with no token to learn after truncation to max_length=%d",
                source,
                dropped,
                len(records),
                max_length,
            )
        if not self.examples:
            raise DataValidationError(source, f"no usable rows left after truncation (max_length={max_length})")

    def _segments(self, record: dict, layout: str, columns: dict[str, str], source: str, row: int) -> Segments:
        if layout == "text":
            return [(record[columns["text"]], True)]
        if layout == "prompt_completion":
            return prompt_completion_segments(self.tokenizer, record[columns["prompt"]], record[columns["completion"]])
        segments = assistant_segments(self.tokenizer, record[columns["messages"]])
        if not segments:
            raise DataValidationError(
                source,
                "the chat template renders no assistant turn of this conversation "
                "consistently (see assistant_segments)",
                row,
                columns["messages"],
            )
        return segments

    def _pieces(self, text: str, images: list[Any]) -> tuple[list[int], list[int], list]:
        """(ids, image-token flags, vision inputs) of one piece: its image placeholders through the VL processor
        with the next of ``images`` (``datamodules.vision.encode_pieces``), the rest through the tokenizer."""
        processor = vision_processor(self.tokenizer)
        if processor is not None and images:
            placeholder = image_placeholder(processor)
            return encode_pieces(processor, text, images[: text.count(placeholder)], placeholder)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        return ids, [0] * len(ids), []

    def _tokenize(
        self, segments: Segments, images: list[Any] = (), where: tuple = (), eos_after: bool = True
    ) -> dict[str, Any] | None:
        tok, images = self.tokenizer, list(images)
        bos = tok.bos_token_id if adds_bos(tok) else None  # SmolLM2 declares a BOS it never adds
        eos = tok.eos_token_id if eos_after else None  # the model's own template ended the turn
        ids, mask = ([bos], [0]) if bos is not None else ([], [])
        last_scored, vision, image_end = False, [], 0  # whether the text ends in a scored piece (then so is the EOS)
        for text, scored in segments:
            piece, image, inputs = self._pieces(text, images[len(vision) :])
            if ids and piece and bos is not None and piece[0] == bos and len(ids) == 1:
                piece, image = piece[1:], image[1:]  # a template that writes BOS itself
            if inputs:  # image tokens are never trained on, wherever they are
                image_end = len(ids) + max(i + 1 for i, flag in enumerate(image) if flag)
            ids += piece
            mask += [int((scored or not self.completion_only_loss) and not flag) for flag in image]
            last_scored, vision = scored if piece else last_scored, vision + inputs
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            mask.append(int(last_scored or not self.completion_only_loss))
        if image_end > self.max_length:  # cutting an image's tokens would leave features without their tokens
            raise DataValidationError(*where[:1], f"{image_end} tokens up to the end of its last image: more than "
                                      f"max_length={self.max_length} (an image cannot be cut)", *where[1:])  # fmt: skip
        ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask[1:]):  # the first token is never predicted
            return None
        return {"input_ids": ids, "completion_mask": mask, **({VISION: merged_vision(vision)} if vision else {})}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.examples[index], "index": index}

    def lengths(self) -> list[int]:
        """Tokens per row (for length-grouped sampling)."""
        return [len(e["input_ids"]) for e in self.examples]


class SFTCollator(PaddingCollator):
    """Right pads rows into the batch contract. ``SFTCollator(pad_token_id)``, as ``PaddingCollator``."""

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [e["input_ids"] for e in examples]
        return {
            "input_ids": pad_sequences(ids, self.pad_token_id),
            "attention_mask": pad_sequences([[1] * len(i) for i in ids], 0),
            "completion_mask": pad_sequences([e["completion_mask"] for e in examples], 0),
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
            **(
                {"vision": VisionInputs([e.get(VISION, {}) for e in examples])}
                if any(VISION in e for e in examples)
                else {}
            ),
        }


class SFTDataModule(TextDataModule):
    """SFT rows (conversational, prompt-completion or plain text; see the module docstring) from a file, a
    hub dataset or an in-memory list, checked before training starts.

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file, or a ``datasets`` hub name.
        split: split to load when ``data_path`` is a hub name.
        val_data_path: separate validation file / hub name (else ``val_split`` of the training rows).
        val_split: fraction of the training rows held out for validation (0 for none).
        rows: in-memory rows (dicts with the columns below), instead of ``data_path``.
        messages_column: column holding a conversation (list of ``{role, content}`` messages).
        prompt_column: column holding the prompt of prompt-completion rows.
        completion_column: column holding the completion of prompt-completion rows.
        text_column: column holding plain text (TRL's ``dataset_text_field``).
        tokenizer: tokenizer object or name (``"byte"``, a folder or hub id); the CLI links it from the model.
        completion_only_loss: loss on completions / assistant turns only; ``False``: on every token.
        max_length: longest sequence, in tokens (longer rows are truncated at the end).
        batch_size: rows per training batch.
        eval_batch_size: rows per validation batch (default: ``batch_size``).
        group_by_length: batch rows of similar length together (less padding).
        balance_ranks: under data parallelism, deal each step's rows to the ranks with balanced token counts
            (Karmarkar-Karp, ``losses.micro_batches.balance_ranks``) instead of the distributed sampler's strided
            split: no rank waits on one that drew the long rows (with ``token_budget``, docs/long_context.md).
        shuffle: shuffle the training rows each epoch.
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and the sampling order.
        max_image_pixels: the largest image accepted (width x height) for a vision-language model (an ``images``
            column and content parts, as prompt data has them: ``datamodules.vision``); a larger one is refused
            with its file, row and field.
    """

    collator = SFTCollator

    argument_ranges = {**DATA_RANGES, **rules("max_length", "max_image_pixels")}

    def __init__(
        self,
        data_path: str | None = None,
        split: str = "train",
        val_data_path: str | None = None,
        val_split: float = 0.1,
        rows: list[dict] | None = None,
        messages_column: str = "messages",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        text_column: str = "text",
        tokenizer: Any = None,
        completion_only_loss: bool = True,
        max_length: int = 1024,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        group_by_length: bool = False,
        balance_ranks: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        max_image_pixels: int | None = None,
    ):
        super().__init__(tokenizer, (rows,))
        self.save_arguments(constructor_arguments(SFTDataModule.__init__, locals(), ignore=("tokenizer", "rows")))

    @property
    def columns(self) -> dict[str, str]:
        hp = self.hparams
        return {
            "messages": hp.messages_column,
            "prompt": hp.prompt_column,
            "completion": hp.completion_column,
            "text": hp.text_column,
        }

    # -- reading and checking
    def _in_memory_records(self) -> list[dict]:
        (rows,) = self._in_memory
        if not rows:
            raise DataValidationError(IN_MEMORY, "give data_path or a non-empty in-memory list of rows")
        for i, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise DataValidationError(IN_MEMORY, f"expected a dict, got {type(row).__name__}", i)
        return list(rows)

    def layout(self, records: list[dict], source: str) -> str:
        """``messages``, ``prompt_completion`` or ``text``, from the first row's columns."""
        c, first = self.columns, records[0]
        if c["messages"] in first:
            return "messages"
        if c["prompt"] in first or c["completion"] in first:
            check_columns(records, [c["prompt"], c["completion"]], source)
            return "prompt_completion"
        if c["text"] in first:
            return "text"
        raise DataValidationError(
            source,
            f"no SFT columns: expected {c['messages']!r}, {c['prompt']!r} + "
            f"{c['completion']!r}, or {c['text']!r}; columns found: {', '.join(first)}",
        )

    def _rows(self, records: list[dict], source: str) -> list[dict]:
        """Check every row (once, before any split) against the layout of the first."""
        layout = self.layout(records, source)
        fields = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "text": ["text"]}[layout]
        processor, checked = vision_processor(self.tokenizer), []
        for row, record in enumerate(records, start=1):
            if processor is not None:  # a VL model: content parts flattened, the row's images read and checked
                names = [self.columns[f] for f in fields]
                found = RowImages(processor, record, names, source, row, self.hparams.max_image_pixels)
                record = {**record, **found.values, IMAGES: found.images}
            checked.append(record)
            for field in (self.columns[f] for f in fields):
                if field not in record:
                    raise DataValidationError(source, "missing field", row, field)
                check_text(record[field], source, row, field, allow_messages=layout != "text")
                if layout == "messages" and not is_messages(record[field]):
                    raise DataValidationError(source, "expected a list of {role, content} messages", row, field)
                if layout == "messages" and not any(m["role"] == "assistant" for m in record[field]):
                    raise DataValidationError(source, "no assistant message", row, field)
        return checked

    def _dataset(self, records: list[dict], source: str) -> SFTDataset:
        hp = self.hparams
        return SFTDataset(
            records,
            self.layout(records, source),
            self.columns,
            self.tokenizer,
            hp.max_length,
            hp.completion_only_loss,
            source,
        )

    # -- loaders
    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if hp.group_by_length:
            sampler = LengthGroupedSampler(self.train_dataset.lengths(), hp.batch_size, seed=hp.seed)
            return self._loader(self.train_dataset, hp.batch_size, sampler=sampler)
        return self._loader(self.train_dataset, hp.batch_size, shuffle=hp.shuffle)

    def test_dataloader(self):
        return self.val_dataloader()
