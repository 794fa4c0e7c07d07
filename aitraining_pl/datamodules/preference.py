"""Preference pairs (prompt, chosen, rejected): dataset, collator and ``PreferenceDataModule``.

Batch contract (used by DPO and reward-model training): a dict with

- ``input_ids`` (2B, L): the B chosen sequences (prompt + completion + EOS) first, then the B rejected ones;
- ``attention_mask`` (2B, L): 1 on real tokens;
- ``completion_mask`` (2B, L): 1 on completion tokens, including the appended EOS;
- ``index`` (B,): the pair's position in its dataset;
- ``margin`` (B,) float, only when a margin column is configured;

right padded to the longest sequence in the batch (never to ``max_length``).
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from aitraining_pl.datamodules.base import IN_MEMORY, TextDataModule
from aitraining_pl.datamodules.io import DataValidationError, check_columns, check_text, is_messages, pad_sequences
from aitraining_pl.datamodules.resumable import SeededShuffleSampler
from aitraining_pl.models.tokens import with_bos

log = logging.getLogger(__name__)

#: Chat template used for conversational rows when the tokenizer has none (e.g. the byte tokenizer).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _shared_prefix(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """Split two full conversations into (prompt, chosen completion, rejected completion) at their longest
    shared prefix (Anthropic HH style). Message lists split on whole messages, strings on characters."""
    n = 0
    limit = min(len(chosen), len(rejected)) - 1  # leave at least one element of each completion
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


class PreferenceDataset(Dataset):
    """Tokenised preference pairs, built once (the seed's ``PreferenceDataset`` signature).

    Args:
        prompts: prompt per pair: a string or a list of ``{role, content}`` messages; ``None`` to split each
            chosen/rejected conversation at its shared prefix.
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
        prompts: Optional[Sequence[Any]],
        chosen: Sequence[Any],
        rejected: Sequence[Any],
        tokenizer: Any,
        max_length: int = 512,
        max_prompt_length: int = 256,
        margins: Optional[Sequence[float]] = None,
        source: str = IN_MEMORY,
    ):
        if len(chosen) != len(rejected) or (prompts is not None and len(prompts) != len(chosen)):
            raise DataValidationError(source, "prompts, chosen and rejected must have the same length")
        if max_prompt_length >= max_length:
            raise ValueError(f"max_prompt_length ({max_prompt_length}) must be < max_length ({max_length})")
        self.tokenizer, self.max_length, self.max_prompt_length = tokenizer, max_length, max_prompt_length
        self.examples: list[dict[str, Any]] = []
        dropped, identical = 0, 0
        for i in range(len(chosen)):
            prompt, good, bad = (prompts[i] if prompts is not None else None), chosen[i], rejected[i]
            if prompt is None:
                prompt, good, bad = _shared_prefix(good, bad)
            identical += good == bad
            example = self._tokenize(prompt, good, bad)
            if example is None:
                dropped += 1
                continue
            if margins is not None:
                example["margin"] = float(margins[i])
            example["row"] = i
            self.examples.append(example)
        if identical:
            log.warning("%s: %d pair(s) have chosen identical to rejected (they carry no preference signal)", source, identical)
        if dropped:
            log.warning(
                "%s: dropped %d of %d pair(s) whose completion was empty after truncation to max_length=%d, "
                "max_prompt_length=%d", source, dropped, len(chosen), max_length, max_prompt_length,
            )
        if not self.examples:
            raise DataValidationError(source, "no usable pairs left after truncation (raise max_length?)")

    # -- tokenisation
    def _texts(self, prompt: Any, completion: Any) -> tuple[str, str]:
        """Prompt and completion as text; message lists go through the chat template."""
        if not (is_messages(prompt) or is_messages(completion)):
            return prompt, completion
        tok = self.tokenizer
        prompt_messages = prompt if is_messages(prompt) else ([{"role": "user", "content": prompt}] if prompt else [])
        completion_messages = (
            completion if is_messages(completion) else [{"role": "assistant", "content": completion}]
        )
        template = None if getattr(tok, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        prompt_text = tok.apply_chat_template(
            prompt_messages, tokenize=False, add_generation_prompt=True, chat_template=template
        )
        full = tok.apply_chat_template(prompt_messages + completion_messages, tokenize=False, chat_template=template)
        if full.startswith(prompt_text):
            return prompt_text, full[len(prompt_text) :]
        plain = tok.apply_chat_template(prompt_messages, tokenize=False, chat_template=template)
        return plain, full[len(plain) :]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _tokenize(self, prompt: Any, chosen: Any, rejected: Any) -> Optional[dict[str, Any]]:
        prompt_text, chosen_text = self._texts(prompt, chosen)
        _, rejected_text = self._texts(prompt, rejected)
        tok = self.tokenizer
        prompt_ids = with_bos(self._ids(prompt_text), tok)
        if not prompt_ids and tok.eos_token_id is not None:
            # nothing to condition on (no prompt, no BOS): start from EOS, as GPT-2 style models do, so the
            # first completion token is scored instead of the pair being dropped
            prompt_ids = [tok.eos_token_id]
        prompt_ids = prompt_ids[-self.max_prompt_length :]
        room = self.max_length - len(prompt_ids)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        chosen_ids = (self._ids(chosen_text) + eos)[:room]
        rejected_ids = (self._ids(rejected_text) + eos)[:room]
        if not chosen_ids or not rejected_ids or not prompt_ids:
            return None
        return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.examples[index], "index": index}

    def lengths(self) -> list[int]:
        """Longest of the two sequences of each pair (for length-grouped sampling)."""
        return [len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in self.examples]


class PreferenceCollator:
    """Pads a list of pairs into the batch contract (chosen rows first, then rejected, right padded).

    Args:
        pad_token_id: id used for padding (masked out everywhere).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

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


class PreferenceDataModule(TextDataModule):
    """Preference pairs from a file, a hub dataset or in-memory lists, checked before training starts.

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file, or a ``datasets`` hub name.
        split: split to load when ``data_path`` is a hub name.
        val_data_path: separate validation file / hub name (else ``val_split`` of the training rows).
        val_split: fraction of the training rows held out for validation (0 for none).
        prompt_column: column holding the prompt; when the data has no such column, each chosen/rejected
            pair is split at its shared prefix (Anthropic HH style).
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
        shuffle: shuffle the training pairs each epoch (off: file order, e.g. for benchmarks).
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and the sampling order.
    """

    collator = PreferenceCollator

    def __init__(
        self,
        data_path: Optional[str] = None,
        split: str = "train",
        val_data_path: Optional[str] = None,
        val_split: float = 0.1,
        prompt_column: str = "prompt",
        chosen_column: str = "chosen",
        rejected_column: str = "rejected",
        margin_column: Optional[str] = None,
        prompts: Optional[list] = None,
        chosen: Optional[list] = None,
        rejected: Optional[list] = None,
        tokenizer: Any = None,
        max_length: int = 512,
        max_prompt_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: Optional[int] = None,
        group_by_length: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(tokenizer, (prompts, chosen, rejected))
        self.save_hyperparameters(ignore=["tokenizer", "prompts", "chosen", "rejected"])

    # -- reading and checking
    def _rows(self, records: list[dict], source: str) -> list[dict]:
        """Check every row (once, before any split); rows without a prompt column are split later."""
        hp = self.hparams
        needed = [hp.chosen_column, hp.rejected_column] + ([hp.margin_column] if hp.margin_column else [])
        check_columns(records, needed, source)
        has_prompt = hp.prompt_column in records[0]
        if not has_prompt:
            log.warning("%s: no %r column; using the shared prefix of chosen and rejected as the prompt", source, hp.prompt_column)
        for row, record in enumerate(records, start=1):
            for field in ([hp.prompt_column] if has_prompt else []) + [hp.chosen_column, hp.rejected_column]:
                if field not in record:
                    raise DataValidationError(source, "missing field", row, field)
                check_text(record[field], source, row, field)
            if hp.margin_column:
                value = record.get(hp.margin_column)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise DataValidationError(source, f"expected a finite number, got {value!r}", row, hp.margin_column)
        return records

    def _in_memory_records(self) -> list[dict]:
        hp = self.hparams
        prompts, chosen, rejected = self._in_memory
        if chosen is None or rejected is None:
            raise DataValidationError(IN_MEMORY, "give data_path, or in-memory chosen and rejected lists")
        if len(chosen) != len(rejected) or (prompts is not None and len(prompts) != len(chosen)):
            raise DataValidationError(IN_MEMORY, "prompts, chosen and rejected must have the same length")
        records = [
            {hp.chosen_column: c, hp.rejected_column: r, **({hp.prompt_column: prompts[i]} if prompts is not None else {})}
            for i, (c, r) in enumerate(zip(chosen, rejected))
        ]
        if not records:
            raise DataValidationError(IN_MEMORY, "no rows")
        return records

    def _dataset(self, records: list[dict], source: str) -> PreferenceDataset:
        hp = self.hparams
        column = lambda name: [r[name] for r in records] if name and name in records[0] else None  # noqa: E731
        return PreferenceDataset(
            column(hp.prompt_column), column(hp.chosen_column), column(hp.rejected_column), self.tokenizer,
            hp.max_length, hp.max_prompt_length, column(hp.margin_column), source
        )

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
