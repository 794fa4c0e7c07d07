"""Stop (or skip the batch) when the training loss or the gradient norm is not finite; stop when the weights
become non-finite after an optimizer step."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch

ACTIONS = ("stop", "skip")


class NonFiniteError(FloatingPointError):
    """The training loss or gradient norm became NaN or infinite; the message names the metric and step."""

    what = "training"  #: the kind the command line prints: ``aitraining-pl: training error: ...``


def gradient_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients of ``parameters`` (local shards under FSDP2), as a float32 scalar."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))


def first_nonfinite(losses: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether any of ``losses`` holds a NaN or inf (1.0 or 0.0) and the first element of the first such loss
    (NaN when none), as two float32 scalars on ``device``, read by the host later (no sync here)."""
    if not losses:
        return torch.zeros((), device=device), torch.full((), math.nan, device=device)
    finite = torch.stack([torch.isfinite(loss).all() for loss in losses]).to(device)
    firsts = torch.stack([loss.float().reshape(-1)[0] for loss in losses]).to(device)
    index = (~finite).int().argmax()  # the first non-finite loss (0 when every one is finite)
    return (~finite).any().float(), torch.where(finite.all(), math.nan, firsts[index])


def first_nonfinite_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first trainable parameter holding a NaN or inf (local shards under FSDP2), else None.
    One fused norm per parameter list (``torch._foreach_norm``) and one host sync: the norm of a tensor is finite
    only when every element is."""
    named = [
        (n, p.to_local() if hasattr(p, "to_local") else p) for n, p in module.named_parameters() if p.requires_grad
    ]
    named = [(n, p.detach()) for n, p in named if p.numel()]
    if not named:
        return None
    norms = torch.stack(torch._foreach_norm([p for _, p in named])).float()
    finite = torch.isfinite(norms)
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def check_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule, what: str) -> None:
    """Raise ``NonFiniteError`` on every rank when any rank's trainable parameters hold a NaN or inf (after an
    optimizer step, e.g. a learning rate that overflows); ``what`` says what is not written."""
    bad = first_nonfinite_parameter(pl_module)
    flag = torch.tensor([bad is not None], dtype=torch.float32)
    if trainer.world_size > 1:  # every rank takes the same decision
        flag = trainer.strategy.reduce(flag.to(pl_module.device), reduce_op="sum").cpu()
    if bool(flag.any()):
        batch = trainer.fit_loop.epoch_loop.batch_idx
        raise NonFiniteError(
            f"non-finite weights ({bad or 'on another rank'}) after optimizer step {trainer.global_step} (epoch "
            f"{trainer.current_epoch}, batch {batch}); stopped, {what} (lower the learning rate)"
        )


class NonFiniteGuard(pl.Callback):
    """Checks every optimizer step, automatic (DPO, reward models) or manual (PPO): if a loss passed to
    backward since the previous step, or the gradient norm before clipping, is NaN or infinite, it either
    stops the run with ``NonFiniteError`` naming the metric and the step (``action="stop"``: nothing is
    stepped, so no checkpoint or export is written from the bad state, and ``HFExportCallback`` writes no
    ``last``), or drops the gradients so the optimizer leaves every parameter and its moments as they were
    (``action="skip"``), counting such steps in ``train/skipped_nonfinite``.

    ``AlignmentModule`` adds one (``stop``) to every fit unless the trainer has one; add
    ``NonFiniteGuard(action="skip")`` to the trainer's callbacks to skip instead. Under ``16-mixed`` only the
    loss is checked: the gradient scaler skips steps with infinite gradients itself. All ranks decide together.

    After each batch that stepped the optimizer it also checks the weights themselves (one fused norm over the
    trainable parameters): a step that made them NaN or inf (a learning rate that overflows, with finite loss
    and gradients) stops the run, in either action, before a checkpoint is written from them
    (``ModelCheckpoint`` runs after every other callback); ``HFExportCallback`` checks the weights itself
    before each export.

    Args:
        action: ``stop`` (raise) or ``skip`` (drop the step's gradients and go on).
    """

    def __init__(self, action: str = "stop"):
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.action = action
        self.skipped = 0
        self._losses: list[torch.Tensor] = []  # the losses passed to backward since the last optimizer step
        self._checked_step = 0  # global_step whose weights were last checked

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())  # checked at the optimizer step: no host sync per micro-batch

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        losses, self._losses = self._losses, []
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        device = getattr(pl_module, "device", torch.device("cpu"))
        bad, first = first_nonfinite(losses, device)
        norm = torch.full((), math.nan, device=device) if scaled else gradient_norm(parameters).to(device)
        flags = torch.stack([bad, torch.zeros((), device=device) if scaled else (~torch.isfinite(norm)).float()])
        if trainer.world_size > 1:  # every rank takes the same decision (a lone raise would hang the others)
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        bad_loss, bad_norm, bad_value, norm = torch.cat([flags, torch.stack([first, norm.float()])]).tolist()
        if not (bad_loss or bad_norm):  # the one host read of the step (above)
            return
        metric, value = ("train/loss", bad_value) if bad_loss else ("grad_norm", norm)
        where = (
            f"at global_step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_idx})"
        )
        if self.action == "stop":
            raise NonFiniteError(
                f"non-finite {metric} ({value}) {where}; stopped before the optimizer step, nothing saved from this "
                "state (lower the learning rate, or add NonFiniteGuard(action='skip') to skip such batches)"
            )
        for p in parameters:  # AdamW leaves parameters without a gradient (and their moments) untouched
            p.grad = None
        self.skipped += 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self._checked_step:  # an optimizer step was taken in this batch
            self._checked_step = trainer.global_step
            check_parameters(trainer, pl_module, "no checkpoint or export written from this state")
        if self.action == "skip":
            pl_module.log("train/skipped_nonfinite", float(self.skipped), on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
