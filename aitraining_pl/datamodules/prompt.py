"""Prompts for on-policy training (PPO): dataset, collator and ``PromptDataModule``.

Batch contract (used by ``PPOModule``): a dict with

- ``input_ids`` (B, P): prompt tokens, LEFT padded (generation appends on the right);
- ``attention_mask`` (B, P): 1 on real tokens;
- ``prompts``: list of B prompt texts (after the chat template), passed to the reward source;
- ``metadata``: list of B dicts, the row's extra columns (e.g. a math problem's answer), passed to the
  reward source.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from torch.utils.data import DataLoader, Dataset

from aitraining_pl.datamodules.base import IN_MEMORY, TextDataModule
from aitraining_pl.datamodules.io import DataValidationError, check_columns, check_text, is_messages, pad_sequences
from aitraining_pl.datamodules.preference import FALLBACK_CHAT_TEMPLATE
from aitraining_pl.datamodules.resumable import SeededShuffleSampler
from aitraining_pl.models.tokens import with_bos

log = logging.getLogger(__name__)


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
        metadata: Optional[Sequence[dict]] = None,
        max_prompt_length: int = 256,
        use_chat_template: bool = False,
    ):
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"{len(metadata)} metadata rows for {len(prompts)} prompts")
        self.tokenizer = tokenizer
        self.texts = [self._render(p, use_chat_template) for p in prompts]
        self.metadata = [dict(m) for m in metadata] if metadata is not None else [{} for _ in prompts]
        self.input_ids = []
        for text in self.texts:
            ids = with_bos(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer)
            self.input_ids.append(ids[-max_prompt_length:])

    def _render(self, prompt: Any, use_chat_template: bool) -> str:
        if not (is_messages(prompt) or use_chat_template):
            return prompt
        messages = prompt if is_messages(prompt) else [{"role": "user", "content": prompt}]
        template = None if getattr(self.tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "prompt": self.texts[index], "metadata": self.metadata[index]}


class PromptCollator:
    """Left-pads prompts into the batch contract.

    Args:
        pad_token_id: id used for padding.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        ids = [e["input_ids"] for e in examples]
        return {
            "input_ids": pad_sequences(ids, self.pad_token_id, side="left"),
            "attention_mask": pad_sequences([[1] * len(i) for i in ids], 0, side="left"),
            "prompts": [e["prompt"] for e in examples],
            "metadata": [e["metadata"] for e in examples],
        }


class PromptDataModule(TextDataModule):
    """Prompts from a file, a hub dataset or an in-memory list, checked before training starts.

    Training batches have a fixed size (the last incomplete batch is dropped), so every rank runs the same
    number of PPO minibatches.

    Args:
        data_path: local JSONL / JSON / Parquet / CSV file, or a ``datasets`` hub name.
        split: split to load when ``data_path`` is a hub name.
        val_data_path: separate validation prompts (file or hub name); else ``val_split`` of the rows.
        val_split: fraction of the rows held out for validation (0 for none).
        prompt_column: column holding the prompt (a string or chat messages).
        metadata_columns: columns passed to the reward source as per-row metadata (default: every other
            column).
        prompts: in-memory prompts (instead of ``data_path``).
        metadata: in-memory metadata, one dict per prompt.
        tokenizer: tokenizer object or name (``"byte"``, a folder or hub id); the CLI links it from the model.
        use_chat_template: render string prompts through the tokenizer's chat template as a user turn.
        max_prompt_length: longest prompt, in tokens (its end is kept).
        batch_size: prompts per PPO iteration (per device); the seed's ``batch_size``.
        eval_batch_size: prompts per validation batch (default: ``batch_size``).
        num_workers: DataLoader worker processes.
        seed: seed of the validation split and of the prompt order.
    """

    collator = PromptCollator

    def __init__(
        self,
        data_path: Optional[str] = None,
        split: str = "train",
        val_data_path: Optional[str] = None,
        val_split: float = 0.0,
        prompt_column: str = "prompt",
        metadata_columns: Optional[list[str]] = None,
        prompts: Optional[list] = None,
        metadata: Optional[list[dict]] = None,
        tokenizer: Any = None,
        use_chat_template: bool = False,
        max_prompt_length: int = 256,
        batch_size: int = 16,
        eval_batch_size: Optional[int] = None,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(tokenizer, (prompts, metadata))
        self.save_hyperparameters(ignore=["tokenizer", "prompts", "metadata"])

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
                raise DataValidationError(IN_MEMORY, f"metadata must be a dict, got {type(meta).__name__}", i + 1, "metadata")
            records.append({**meta, self.hparams.prompt_column: prompt})
        if not records:
            raise DataValidationError(IN_MEMORY, "no rows")
        return records

    def _rows(self, records: list[dict], source: str) -> list[dict]:
        hp = self.hparams
        check_columns(records, [hp.prompt_column] + list(hp.metadata_columns or []), source)
        for row, record in enumerate(records, start=1):
            if hp.prompt_column not in record:
                raise DataValidationError(source, "missing field", row, hp.prompt_column)
            check_text(record[hp.prompt_column], source, row, hp.prompt_column)
            for column in hp.metadata_columns or []:
                if column not in record:
                    raise DataValidationError(source, "missing field", row, column)
        return records

    def _dataset(self, records: list[dict], source: str) -> PromptDataset:
        hp = self.hparams
        columns = hp.metadata_columns
        metadata = [
            {k: v for k, v in r.items() if k != hp.prompt_column and (columns is None or k in columns)} for r in records
        ]
        return PromptDataset(
            [r[hp.prompt_column] for r in records], self.tokenizer, metadata, hp.max_prompt_length, hp.use_chat_template
        )

    def setup(self, stage: Optional[str] = None) -> None:
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
        return dataset.texts[:n], dataset.metadata[:n]
