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


def fused_adamw_applies(params: Iterable[torch.nn.Parameter], plain_precision: bool) -> bool:
    """Whether AdamW may run fused (``torch.optim.AdamW(fused=True)``, the Hugging Face Trainer's default): one
    kernel per parameter instead of a sequence of operators, each of which allocates a temporary the size of the
    parameter (with a 152k vocabulary, two of 155 MB for the embedding and for the head at the optimizer step).
    Only under Lightning's plain precision plugin (``32-true``; it refuses gradient clipping with a fused optimizer
    under its mixed-precision plugins) and for plain floating-point tensors on a device torch has fused kernels
    for (CPU from torch 2.4); sharded (DTensor) parameters keep the default."""
    params = list(params)
    if not plain_precision or not params:
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # pragma: no cover - a torch without the helper
        return False
    devices = _get_fused_kernels_supported_devices()
    return all(type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in devices for p in params)


def adamw_with_warmup(
    params: Iterable[torch.nn.Parameter],
    *,
    learning_rate: float,
    total_steps: int,
    warmup_ratio: float = 0.0,
    schedule: str = "linear",
    weight_decay: float = 0.0,
    fused: bool = False,
) -> dict:
    """The ``configure_optimizers`` return value: AdamW (``fused``: see ``fused_adamw_applies``) and a per-step
    warmup/decay LambdaLR."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=learning_rate, weight_decay=weight_decay, **({"fused": True} if fused else {})
    )
    total_steps = max(1, int(total_steps))
    warmup_steps = int(warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_decay_factor(step, total_steps, warmup_steps, schedule)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
