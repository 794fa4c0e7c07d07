"""Direct preference optimisation (Rafailov et al. 2023) and its variants as a LightningModule."""

from __future__ import annotations

from typing import Any

import torch

from aitraining_pl.losses import REFERENCE_FREE, dpo_loss
from aitraining_pl.losses.preference import DPOLossType
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.packing import (  # noqa: F401 - PackedBatch, can_pack, pack_batch: re-exported
    PackedBatch,
    can_pack,
    pack_batch,
    prompt_lengths,
)
from aitraining_pl.models.scoring import completion_logps
from aitraining_pl.models.training import eval_mode
from aitraining_pl.modules.base import SharedStepModule
from aitraining_pl.optim import LRSchedule
from aitraining_pl.validation import RENAMED, renamed


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(B,) 1 where the chosen reward is higher, 0 where lower, 0.5 on ties: an untrained policy (equal to
    its reference, all rewards 0) scores 0.5, as a coin flip would."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


class DPOModule(SharedStepModule):
    """DPO and its variants (IPO, SLiC hinge, robust DPO, conservative DPO, SimPO) on preference batches.

    Args:
        model_name: folder or hub id of the policy (a causal LM).
        model_config: inline transformers config for a randomly initialised policy (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the policy (``LoRAConfig``, or a ``peft.LoraConfig`` in Python); the reference is
            then the policy with adapters disabled.
        beta: temperature of the implicit reward ``beta * log(pi / pi_ref)``.
        loss_type: ``sigmoid`` (DPO), ``robust``, ``hinge`` (SLiC), ``ipo`` or ``simpo``.
        label_smoothing: assumed label-flip rate for ``sigmoid`` (conservative DPO) and ``robust``.
        reference_free: treat the reference as uniform (no reference model is loaded).
        simpo_gamma: target reward margin of SimPO.
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        precompute_ref_log_probs: compute reference log-probs for every pair in one pass before training, then
            release the reference model.
        padding_free: run the batch's real tokens packed end to end in one row, attention block by block
            (no work on padding; the same log-probs as padded rows). Used when the model's attention is SDPA or
            eager with no sliding window (Llama, Qwen2, Mistral, ...); other models run padded.
        share_prompt: pack each pair as one sequence holding its prompt once (the rejected completion attends
            to the prompt and itself, with the same log-probs as separate rows): fewer tokens in every layer.
        dtype: weights dtype when loading (``bfloat16``, ``float32``, ...; default: as stored / float32).
        seed: seed of the random initialisation when ``model_config`` is used.
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``;
            default: transformers' choice, SDPA where supported).
        disable_dropout: set every dropout rate to 0 (policy and reference), as TRL does:
            training forwards are then deterministic.
        gradient_checkpointing: recompute activations in backward instead of storing them (less memory, about a
            third more compute); works on the packed path.
        precompute_ref_logps: deprecated spelling of ``precompute_ref_log_probs`` (TRL's name; accepted with a
            warning until the next release).
    """

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        beta: float = 0.1,
        loss_type: DPOLossType = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        simpo_gamma: float = 0.5,
        learning_rate: float = 1e-6,
        warmup_ratio: float = 0.1,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        precompute_ref_log_probs: bool = False,
        padding_free: bool = True,
        share_prompt: bool = True,
        dtype: str | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        precompute_ref_logps: bool | None = None,
    ):
        super().__init__()
        precompute_ref_log_probs = renamed(
            type(self).__name__,
            "precompute_ref_log_probs",
            precompute_ref_log_probs,
            False,
            precompute_ref_logps=precompute_ref_logps,
        )
        self.save_hyperparameters(ignore=["lora", *RENAMED])
        self.drop_renamed_hparams(precompute_ref_log_probs=bool(precompute_ref_log_probs))
        self.store_lora_hparam(lora)
        from aitraining_pl.losses import DPO_LOSSES

        if loss_type not in DPO_LOSSES:
            raise ValueError(f"unknown loss_type {loss_type!r}; known: {', '.join(sorted(DPO_LOSSES))}")
        self.uses_reference = not (reference_free or loss_type in REFERENCE_FREE)
        self.policy, self.reference = self.load_policy_from_hparams(with_reference=self.uses_reference)
        self.apply_training_options(self.reference.model if self.reference is not None else None)
        self._ref_cache: dict[str, torch.Tensor] = {}  # split -> (N, 2) precomputed reference log-probs

    # ------------------------------------------------------------------ reference log-probs
    def _place_reference(self) -> None:
        if self.reference is not None:  # a no-op under LoRA and once the frozen copy was released
            self.reference.to(self.device, next(self.policy.parameters()).dtype)

    def on_fit_start(self) -> None:
        self._place_reference()
        if self.reference is not None and self.hparams.precompute_ref_log_probs:
            self.precompute_reference()

    def on_validation_start(self) -> None:
        self._place_reference()

    def on_test_start(self) -> None:
        self._place_reference()

    @torch.no_grad()
    def _reference_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(2B,) reference log-probs: the frozen copy, or the policy with adapters disabled, in eval mode."""
        model = self.reference.model
        with eval_mode(model), self.reference.context():
            return completion_logps(model, batch, self.hparams.padding_free, self.hparams.share_prompt).logps

    def precompute_reference(self) -> None:
        """One pass over every split of the data module; afterwards the frozen reference copy is released."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "ordered_dataloaders"):
            raise ValueError(
                "precompute_ref_log_probs needs a data module with ordered_dataloaders() (PreferenceDataModule)"
            )
        # fork the RNG: creating DataLoader iterators draws from it, and the training order must not change
        with torch.random.fork_rng(devices=[]), self.trainer.precision_plugin.forward_context():
            for split, loader in datamodule.ordered_dataloaders().items():
                chunks = []
                for batch in loader:
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    logps = self._reference_forward(batch)
                    chunks.append(torch.stack(logps.chunk(2), dim=1))
                self._ref_cache[split] = torch.cat(chunks)
        self.reference.drop()

    def reference_logps(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) reference log-probs of chosen and rejected: looked up when precomputed, else one forward."""
        split = "val" if split == "test" else split  # the test loader is the validation split
        if split in self._ref_cache:
            pairs = self._ref_cache[split][batch["index"]]
            return pairs[:, 0], pairs[:, 1]
        chosen, rejected = self._reference_forward(batch).chunk(2)
        return chosen, rejected

    # ------------------------------------------------------------------ steps
    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        hp = self.hparams
        # 1. reference log-probs (precomputed, or under no_grad), unless reference-free; first, so that its
        #    activations are freed before the policy's are built (a lower peak)
        ref_chosen, ref_rejected = self.reference_logps(batch, stage) if self.uses_reference else (None, None)
        # 2. policy log-probs of chosen and rejected rows in one forward
        policy = completion_logps(self.policy, batch, hp.padding_free, hp.share_prompt)
        chosen, rejected = policy.logps.chunk(2)
        chosen_len, rejected_len = policy.lengths.chunk(2)
        # 3. the loss
        out = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=hp.beta,
            loss_type=hp.loss_type,
            label_smoothing=hp.label_smoothing,
            reference_free=hp.reference_free,
            chosen_lengths=chosen_len,
            rejected_lengths=rejected_len,
            gamma=hp.simpo_gamma,
        )
        loss = out.losses.mean()
        # 4. metrics
        metrics = {
            "loss": loss,
            "rewards/chosen": out.chosen_rewards,
            "rewards/rejected": out.rejected_rewards,
            "rewards/accuracies": preference_accuracy(out.chosen_rewards, out.rejected_rewards),
            "rewards/margins": out.chosen_rewards - out.rejected_rewards,
            "logps/chosen": chosen,
            "logps/rejected": rejected,
        }
        self.log_metrics(stage, metrics, batch_size=chosen.shape[0], prog_bar=("loss", "rewards/accuracies"))
        return loss
