"""The held-out reward of greedy answers, before training starts and after it ends: what a newcomer sees change."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info


class GreedyEvalCallback(pl.Callback):
    """Before training starts and after it ends, answer every held-out prompt greedily (the module's generation
    settings with ``do_sample: false``), score the answers with the module's reward source, and print the mean
    reward and a few answers; the two figures are logged as ``val/greedy_reward`` (at the first and the last
    step) and kept in ``results`` (``{"before": ..., "after": ...}``). For the online modules (PPO, GRPO, RLOO, ...)
    on a ``PromptDataModule`` with held-out prompts; their own ``val/reward_mean`` samples at the training
    temperature, whose noise hides a small model's change, while a greedy answer is what the model says when used.

    Args:
        num_samples: answers printed each time (those to the first held-out prompts).
    """

    def __init__(self, num_samples: int = 2):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.results: dict[str, float] = {}
        self.answers: dict[str, list[str]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report(trainer, pl_module, "before")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report(trainer, pl_module, "after")

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        loader = _held_out_loader(trainer)
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # training draws the same random numbers with or without it
            answers, scores = greedy_answers(pl_module, loader)
        mean = sum(scores) / len(scores)
        self.results[when], self.answers[when] = mean, answers
        lines = [f"held-out greedy reward {when} training: {mean:.3f} ({len(scores)} prompts)"]
        lines += [f"  answer {i + 1}: {a!r} (reward {s:.3f})" for i, (a, s) in enumerate(zip(answers, scores))][
            : self.num_samples
        ]
        rank_zero_info("\n".join(lines))
        for logger in trainer.loggers:
            logger.log_metrics({"val/greedy_reward": mean}, step=trainer.global_step)


def _held_out_loader(trainer: pl.Trainer):
    datamodule = trainer.datamodule
    loader = datamodule.val_dataloader() if datamodule is not None and hasattr(datamodule, "val_dataloader") else None
    if not loader:
        raise ValueError(
            "GreedyEvalCallback needs held-out prompts: a PromptDataModule with val_split or val_data_path"
        )
    return loader


def greedy_answers(pl_module: pl.LightningModule, batches: Any) -> tuple[list[str], list[float]]:
    """``(greedy answers, rewards)`` of an online module for prompt batches (``PromptCollator``'s: left
    padded ``input_ids`` and ``attention_mask``, ``prompts``, ``metadata``)."""
    greedy = dataclasses.replace(pl_module.generation, do_sample=False)
    answers, scores = [], []
    for batch in batches:
        ids, mask = (batch[k].to(pl_module.device) for k in ("input_ids", "attention_mask"))
        rollout = pl_module.generate(ids, mask, greedy)
        batch_scores, _ = pl_module.score(batch["prompts"], batch["metadata"], rollout)
        answers += list(rollout.texts)
        scores += [float(s) for s in batch_scores]
    return answers, scores
