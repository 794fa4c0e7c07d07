"""AdamW with linear warmup followed by linear, cosine or constant decay (as in transformers'
``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

SCHEDULES = ("linear", "cosine", "constant")
#: The ``lr_schedule`` values, as a type; equal to ``SCHEDULES`` (tested).
LRSchedule = Literal["linear", "cosine", "constant"]


def warmup_decay_factor(step: int, total_steps: int, warmup_steps: int, schedule: str = "linear") -> float:
    """Learning-rate multiplier at optimizer step ``step``: rises linearly from 0 to 1 over ``warmup_steps``,
    then decays to 0 at ``total_steps`` (``linear``, ``cosine``) or stays at 1 (``constant``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_with_warmup(
    params: Iterable[torch.nn.Parameter],
    *,
    learning_rate: float,
    total_steps: int,
    warmup_ratio: float = 0.0,
    schedule: str = "linear",
    weight_decay: float = 0.0,
) -> dict:
    """The ``configure_optimizers`` return value: AdamW and a per-step warmup/decay LambdaLR."""
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=learning_rate, weight_decay=weight_decay)
    total_steps = max(1, int(total_steps))
    warmup_steps = int(warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_decay_factor(step, total_steps, warmup_steps, schedule)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
