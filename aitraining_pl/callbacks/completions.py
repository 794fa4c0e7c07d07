"""The completions an online RL module trains on, logged as it trains on them (TRL's ``log_completions``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from aitraining_pl.callbacks.sampling import log_rows
from aitraining_pl.validation import check_arguments, rules


class CompletionLogCallback(pl.Callback):
    """Every ``every_n_steps`` training batches (iterations) of ``PPOModule`` / ``GRPOModule`` / ``RLOOModule``,
    logs each sampled response of that iteration: ``step``, ``prompt``, ``completion``, ``reward`` (the score
    trained on, after any missing-EOS penalty), each reward component (``reward/<name>``) and ``advantage`` (its
    mean over the response's tokens). Rows go to ``<log_dir>/<filename>`` as JSONL and, when a ``WandbLogger`` is
    attached, to the W&B table ``completions`` as well. Written by rank zero, with every rank's rows gathered.

    Unlike ``SamplingCallback`` (fresh samples for fixed prompts), nothing is generated here: these are the rollouts
    the update used.

    Args:
        every_n_steps: logging period in training batches (each is one rollout and its update).
        filename: JSONL file name inside the log folder.
    """

    argument_ranges = rules("every_n_steps")

    def __init__(self, every_n_steps: int = 1, filename: str = "completions.jsonl"):
        check_arguments(self.argument_ranges, {"every_n_steps": every_n_steps}, type(self).__name__)
        self.every_n_steps, self.filename = int(every_n_steps), filename
        self.path: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "completion_rows"):
            raise TypeError(f"CompletionLogCallback needs an online RL module, not {type(pl_module).__name__}")
        pl_module.record_completions = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        iteration = trainer.fit_loop.epoch_loop.batch_progress.total.processed  # this one included
        if iteration % self.every_n_steps:
            return
        rows = list(pl_module.last_completions)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[list[dict]] = [[] for _ in range(trainer.world_size)]
            torch.distributed.all_gather_object(gathered, rows)
            rows = [row for part in gathered for row in part]
        if trainer.is_global_zero:
            self.path = log_rows(trainer, "completions", rows, self.filename, jsonl_with_wandb=True) or self.path
