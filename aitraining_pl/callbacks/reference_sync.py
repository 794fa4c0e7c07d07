"""TR-DPO's reference updates (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment") as a
Lightning callback, for DPO and the online RL modules (TRL's ``sync_ref_model``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.validation import check_arguments, rules


class SyncReferenceCallback(pl.Callback):
    """Every ``ref_model_sync_steps`` optimizer steps, moves the frozen reference towards the policy:
    ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref`` (``models.ReferencePolicy
    .mix_in_policy``). TRL's ``sync_ref_model: true`` with the same two arguments; works with ``DPOModule``,
    ``PPOModule`` and the critic-free modules, on a reference that is a separate frozen copy (not under LoRA, not
    with ``precompute_ref_log_probs``, not with ``kl_coef: 0``).

    The check runs after each training batch: an online module makes several optimizer steps per batch, so the
    update happens at the end of the batch in which ``global_step`` passed a multiple of ``ref_model_sync_steps``
    (once, however many multiples it passed). The moved reference is saved in this callback's checkpoint state
    (the frozen copy is otherwise never saved) and restored on resume.

    Args:
        ref_model_mixup_alpha: weight of the policy in the update (TRL's default 0.6; 1.0: the reference becomes
            a copy of the policy).
        ref_model_sync_steps: optimizer steps between updates (TRL's default 512).
    """

    argument_ranges = rules("ref_model_mixup_alpha", "ref_model_sync_steps")

    def __init__(self, ref_model_mixup_alpha: float = 0.6, ref_model_sync_steps: int = 512):
        values = {"ref_model_mixup_alpha": ref_model_mixup_alpha, "ref_model_sync_steps": ref_model_sync_steps}
        check_arguments(self.argument_ranges, values, type(self).__name__)
        self.alpha = float(ref_model_mixup_alpha)
        self.sync_steps = int(ref_model_sync_steps)
        self.syncs = 0  #: updates made so far
        self._restored: dict[str, torch.Tensor] | None = None
        self._module: list[pl.LightningModule] = []

    @staticmethod
    def _reference(pl_module: pl.LightningModule):
        reference = getattr(pl_module, "reference", None)
        owner = f"{type(pl_module).__name__} with SyncReferenceCallback"
        if reference is None:
            raise ConfigError(owner, "the module has no reference model (reference_free, a reference-free loss_type "
                                     "or kl_coef: 0): there is nothing to sync")  # fmt: skip
        if reference.shares_weights:
            raise ConfigError(owner, "under LoRA the reference is the policy with adapters off and cannot be synced")
        if pl_module.hparams.get("precompute_ref_log_probs"):
            raise ConfigError(owner, "precompute_ref_log_probs fixes the reference log-probs: set it to false")
        return reference

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reference(pl_module)  # refuse before training starts
            self._module = [pl_module]  # read by state_dict, which Lightning calls without the module

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restored is not None:  # a resumed run: the reference as it was when the checkpoint was written
            frozen = self._reference(pl_module).frozen_copy
            for name, param in frozen.named_parameters():
                param.data.copy_(self._restored[name].to(param.device, param.dtype))
            self._restored = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        due = trainer.global_step // self.sync_steps
        if due > self.syncs:
            self._reference(pl_module).mix_in_policy(self.alpha)
            self.syncs = due

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"syncs": self.syncs}
        if self.syncs and self._module:  # the reference differs from its source: keep it with the checkpoint
            frozen = self._reference(self._module[0]).frozen_copy
            state["reference"] = {name: p.detach().cpu().clone() for name, p in frozen.named_parameters()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.syncs = int(state_dict.get("syncs", 0))
        self._restored = state_dict.get("reference")
