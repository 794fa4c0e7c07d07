"""Periodic samples during PPO training: prompt, response and reward, as a W&B table or JSONL."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger

from aitraining_pl.datamodules.prompt import PromptCollator, PromptDataset
from aitraining_pl.models.sharding import is_sharded


class SamplingCallback(pl.Callback):
    """Every ``every_n_iterations`` PPO iterations, generate responses for fixed prompts and log
    ``(iteration, step, prompt, response, reward)`` rows (for multi-turn episodes also the whole ``episode`` as
    JSON messages and its metrics: turns, tool calls, tool errors, truncated): as a W&B table (key ``samples``) when a
    ``WandbLogger`` is attached, else appended to ``<log_dir>/samples.jsonl``. Rank zero only (under FSDP2
    every rank generates, since gathering the weights takes every rank, and rank zero logs).

    Args:
        prompts: the prompts to sample for (default: the first ``num_prompts`` of the data module).
        metadata: per-prompt metadata for the reward source (default: the data module's, or ``{}``).
        every_n_iterations: sampling period in PPO iterations (training batches).
        num_prompts: prompts taken from the data module when ``prompts`` is not given.
        filename: JSONL file name inside the log folder.
    """

    def __init__(
        self,
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
        every_n_iterations: int = 10,
        num_prompts: int = 4,
        filename: str = "samples.jsonl",
    ):
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations}")
        self.prompts, self.metadata = prompts, metadata
        self.every_n_iterations, self.num_prompts, self.filename = every_n_iterations, num_prompts, filename
        self.path: str | None = None

    def _fixed_prompts(self, trainer: pl.Trainer) -> tuple[list[str], list[dict]]:
        if self.prompts is None:
            datamodule = trainer.datamodule
            if datamodule is None or not hasattr(datamodule, "sample_prompts"):
                raise ValueError("SamplingCallback needs prompts, or a PromptDataModule to take them from")
            self.prompts, metadata = datamodule.sample_prompts(self.num_prompts)
            self.metadata = self.metadata or metadata
        return list(self.prompts), list(self.metadata or [{} for _ in self.prompts])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        iteration = trainer.fit_loop.epoch_loop.batch_progress.total.processed  # this one included
        if iteration % self.every_n_iterations:
            return
        if not (trainer.is_global_zero or is_sharded(pl_module)):  # sharded: gathering the weights takes every rank
            return
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # training draws the same random numbers with or without it
            rows = self.sample(pl_module, *self._fixed_prompts(trainer))
        if trainer.is_global_zero:
            self.write(trainer, [{"iteration": iteration, "step": trainer.global_step, **r} for r in rows])

    def sample(self, pl_module: pl.LightningModule, prompts: list[str], metadata: list[dict]) -> list[dict]:
        """Generate and score one response per prompt with the module's generation settings."""
        tokenizer = pl_module.tokenizer
        dataset = PromptDataset(prompts, tokenizer, metadata)
        batch = PromptCollator(tokenizer.pad_token_id or 0)([dataset[i] for i in range(len(dataset))])
        device = pl_module.device
        if getattr(pl_module, "episodic", False):
            return self.sample_episodes(
                pl_module, {**batch, **{k: batch[k].to(device) for k in ("input_ids", "attention_mask")}}
            )
        rollout = pl_module.generate(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        scores, _ = pl_module.score(batch["prompts"], batch["metadata"], rollout)
        rows = zip(batch["prompts"], rollout.texts, scores)
        return [{"prompt": p, "response": r, "reward": float(s)} for p, r, s in rows]

    @staticmethod
    def sample_episodes(pl_module: pl.LightningModule, batch: dict[str, Any]) -> list[dict]:
        """One episode per prompt: the whole episode (assistant turns and the environment's replies, as JSON
        messages), its return and its metrics (turns, tool calls, tool errors, truncated, the environment's)."""
        rollout = pl_module.rollout(batch, 1)
        metrics = rollout.episode_metrics or {}
        info = pl_module.last_episodes
        rows = []
        for i, (prompt, score) in enumerate(zip(batch["prompts"], rollout.scores.tolist())):
            episode = json.dumps(info.transcripts[i], ensure_ascii=False) if info is not None else rollout.texts[i]
            rows.append(
                {"prompt": prompt, "response": rollout.texts[i], "reward": float(score), "episode": episode}
                | {name: float(values[i]) for name, values in sorted(metrics.items())}
            )
        return rows

    def write(self, trainer: pl.Trainer, rows: list[dict]) -> None:
        self.path = log_rows(trainer, "samples", rows, self.filename, jsonl_with_wandb=False)


def log_rows(trainer: pl.Trainer, key: str, rows: list[dict], filename: str, jsonl_with_wandb: bool) -> str | None:
    """Log ``rows`` (dicts with the same keys) as a W&B table ``key`` when a ``WandbLogger`` is attached, and append
    them to ``<log_dir>/<filename>`` as JSONL when there is none or ``jsonl_with_wandb``. Returns the JSONL path
    written, if any."""
    wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if wandb_loggers and rows:
        columns = list(rows[0])
        wandb_loggers[0].log_table(key=key, columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        if not jsonl_with_wandb:
            return None
    folder = trainer.log_dir or trainer.default_root_dir
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, filename)
    with open(path, "a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
