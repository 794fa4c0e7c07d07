"""KTO, Kahneman-Tversky optimisation (Ethayarajh et al. 2024), on unpaired labelled completions."""

from __future__ import annotations

from typing import Any

import torch

from aitraining_pl.losses import kto_loss, kto_reference_point
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.quantization import QuantizationConfig
from aitraining_pl.modules.base import MODULE_RANGES
from aitraining_pl.modules.preference import PreferenceModule
from aitraining_pl.optim import LRSchedule
from aitraining_pl.validation import constructor_arguments, rules


class KTOModule(PreferenceModule):
    """KTO on ``KTODataModule`` batches: each completion labelled desirable or undesirable, no pairs needed.

    With ``r = log pi(y|x) - log ref(y|x)`` and the reference point ``z0`` (``losses.kto_reference_point``:
    the batch's mean log-ratio on mismatched prompt/completion rows, averaged across ranks, clamped at 0, no
    gradient), a desirable completion costs ``desirable_weight * (1 - s(beta (r - z0)))`` and an undesirable
    one ``undesirable_weight * (1 - s(beta (z0 - r)))`` (``losses.kto_loss``); the loss is their batch mean.

    Metrics (``train/``, ``val/``): ``loss``, ``kl`` (z0), ``rewards/chosen`` / ``rewards/rejected`` (mean
    ``beta * r`` of the desirable / undesirable completions), ``logps/chosen`` / ``logps/rejected``, and
    ``rewards/margins`` (their difference; per epoch in validation).

    Args:
        model_name: folder or hub id of the policy (a causal LM).
        model_config: inline transformers config for a randomly initialised policy (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the policy (``LoRAConfig``); the reference is
            then the policy with adapters disabled.
        beta: temperature of the implicit reward ``beta * log(pi / pi_ref)``.
        desirable_weight: weight of the desirable completions' loss (lambda_D).
        undesirable_weight: weight of the undesirable completions' loss (lambda_U); the paper keeps
            ``desirable_weight * n_desirable / (undesirable_weight * n_undesirable)`` in [1, 4/3].
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        padding_free: run the batch's real tokens packed end to end in one row (as ``DPOModule``'s).
        share_prompt: pack each row with its mismatched partner as one sequence holding the prompt once.
        dtype: weights dtype when loading (``bfloat16``, ``float32``, ...; default: as stored / float32).
        seed: seed of the random initialisation when ``model_config`` is used.
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (default: transformers' choice).
        disable_dropout: set every dropout rate to 0 (policy and reference), as TRL does.
        token_budget: real tokens per forward pass (TRL's AsyncGRPO name; verl's ``ppo_max_token_len_per_gpu``): the
            batch's rows (pairs kept together) run in balanced micro-batches within it, each but the last recomputed
            in backward, with the whole batch's loss and gradients (docs/long_context.md); a longer row is an error.
            ``null``: the batch in one pass.
        gradient_checkpointing: recompute activations in backward instead of storing them.
        freeze_vision_tower: a vision-language policy's vision encoder gets no gradients (its projector into the
            language model still trains, unless it sits inside the encoder, as Qwen VL's merger does); no effect
            on a text model.
        quantization: load the base weights in 4 bits (QLoRA through bitsandbytes, ``QuantizationConfig``:
            ``{load_in_4bit: true, quant_type: nf4, compute_dtype: bfloat16}``); needs ``lora``.
    """

    argument_ranges = {**MODULE_RANGES, **rules("beta", "desirable_weight", "undesirable_weight")}

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        learning_rate: float = 1e-6,
        warmup_ratio: float = 0.1,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        padding_free: bool = True,
        share_prompt: bool = True,
        dtype: str | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        token_budget: int | None = None,
        freeze_vision_tower: bool = True,
        quantization: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.save_arguments(constructor_arguments(KTOModule.__init__, locals()))
        self.build_models(uses_reference=True)

    def _mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(value, reduce_op="mean") if self._trainer is not None else value

    def objective(self, policy, reference, batch, stage):
        hp = self.hparams
        # the first B rows are the labelled completions, the last B their mismatched partners
        logps, mismatched = policy.logps.chunk(2)
        ref_logps, ref_mismatched = reference.chunk(2)
        z0 = kto_reference_point(mismatched, ref_mismatched, reduce=self._mean_across_ranks)
        desirable = batch["label"].bool()
        out = kto_loss(
            logps,
            ref_logps,
            desirable,
            z0,
            beta=hp.beta,
            desirable_weight=hp.desirable_weight,
            undesirable_weight=hp.undesirable_weight,
        )
        loss = out.losses.mean()
        self.log_metrics(stage, {"loss": loss, "kl": z0}, batch_size=logps.shape[0])
        groups = {"chosen": desirable, "rejected": ~desirable}
        for name, rows in groups.items():
            if rows.any():  # each group's mean, weighted by its size in the epoch averages
                values = {f"rewards/{name}": out.rewards[rows], f"logps/{name}": logps[rows]}
                self.log_metrics(stage, values, batch_size=int(rows.sum()))
        if stage == "train" and desirable.any() and (~desirable).any():
            margin = out.rewards[desirable].mean() - out.rewards[~desirable].mean()
            self.log_metrics(stage, {"rewards/margins": margin}, batch_size=logps.shape[0])
        return loss

    def _log_margin(self, stage: str) -> None:
        """``<stage>/rewards/margins``: the epoch's desirable minus undesirable mean reward (reduced across ranks)."""
        slots = [
            self._epoch_metrics[f"{stage}__rewards__{n}"]
            for n in ("chosen", "rejected")
            if f"{stage}__rewards__{n}" in self._epoch_metrics
        ]
        if len(slots) == 2 and all(m.update_called for m in slots):
            margin = float(slots[0].compute()) - float(slots[1].compute())
            self.log(f"{stage}/rewards/margins", margin, on_epoch=True, batch_size=1)

    def on_validation_epoch_end(self) -> None:
        self._log_margin("val")

    def on_test_epoch_end(self) -> None:
        self._log_margin("test")
