"""Supervised fine-tuning (the first stage of the RLHF pipeline, Ouyang et al. 2022) as a LightningModule."""

from __future__ import annotations

import math
from typing import Any

import torch

from aitraining_pl.losses import sft_loss
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.micro_batches import budgeted_forward
from aitraining_pl.models.packing import pack_rows
from aitraining_pl.models.quantization import QuantizationConfig
from aitraining_pl.models.scoring import scoring_path, token_scores
from aitraining_pl.modules.base import MODULE_RANGES, SharedStepModule
from aitraining_pl.optim import LRSchedule
from aitraining_pl.validation import constructor_arguments


class SFTModule(SharedStepModule):
    """Supervised fine-tuning of a causal LM on the scored tokens of ``SFTDataModule`` batches (completions,
    assistant turns or all tokens): loss = mean token negative log-likelihood over the batch's scored tokens. A
    vision-language model trains on rows with images (``docs/vlm.md``); their image tokens are never scored.

    Metrics: ``train/loss``, ``train/num_tokens`` (real tokens trained on so far, all ranks), ``val/loss``
    (token-weighted over the validation set) and ``val/perplexity`` (``exp`` of it); ``test/`` likewise.
    The export (``save_pretrained``, ``HFExportCallback``) is a plain transformers folder, usable as the
    ``model_name`` of ``DPOModule``, ``RewardModule`` and ``PPOModule``.

    Args:
        model_name: folder or hub id of the model (a causal LM).
        model_config: inline transformers config for a randomly initialised model (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the model (``LoRAConfig``; only they are trained
            and exported, unless merged on export).
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        padding_free: run the batch's real tokens packed end to end in one row, each sequence one causal
            attention block (no work on padding; the same loss as padded rows). Used when the model's
            attention is SDPA or eager with no sliding window; other models run padded.
        dtype: weights dtype when loading (``bfloat16``, ``float32``, ...; default: as stored / float32).
        seed: seed of the random initialisation when ``model_config`` is used (and of LoRA's).
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``;
            default: transformers' choice, SDPA where supported).
        disable_dropout: set every dropout rate to 0 (off by default: SFT keeps the model's dropout, as
            transformers' and TRL's SFT trainers do).
        token_budget: real tokens per forward pass (TRL's AsyncGRPO name; verl's ``ppo_max_token_len_per_gpu``): the
            batch's rows (pairs kept together) run in balanced micro-batches within it, each but the last recomputed
            in backward, with the whole batch's loss and gradients (docs/long_context.md); a longer row is an error.
            ``null``: the batch in one pass.
        gradient_checkpointing: recompute activations in backward instead of storing them (less memory, about a
            third more compute); works on the packed path.
        freeze_vision_tower: a vision-language policy's vision encoder gets no gradients (its projector into the
            language model still trains, unless it sits inside the encoder, as Qwen VL's merger does); no effect
            on a text model.
        quantization: load the base weights in 4 bits (QLoRA through bitsandbytes, ``QuantizationConfig``:
            ``{load_in_4bit: true, quant_type: nf4, compute_dtype: bfloat16}``); needs ``lora``.
    """

    argument_ranges = MODULE_RANGES

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        learning_rate: float = 2e-5,
        warmup_ratio: float = 0.0,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        padding_free: bool = True,
        dtype: str | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        disable_dropout: bool = False,
        gradient_checkpointing: bool = False,
        token_budget: int | None = None,
        freeze_vision_tower: bool = True,
        quantization: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.save_arguments(constructor_arguments(SFTModule.__init__, locals()))
        self.policy, _ = self.load_policy_from_hparams(with_reference=False)
        self.apply_training_options()
        self.num_tokens = 0  #: real tokens trained on, summed over ranks (kept in checkpoints)

    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        # 1. log-probs of the scored tokens (packed rows where exact for the model, else padded; a VL model's rows
        #    with their images, padded: ``models.vision_scoring``)
        #    in micro-batches within ``token_budget`` when set (``models.micro_batches``)
        scored = batch["completion_mask"].bool() & batch["attention_mask"].bool()
        logps = budgeted_forward(self.scored_logps, batch, self.hparam("token_budget"), per_position=True)
        # 2. the loss: mean token NLL over the batch's scored tokens
        n_scored = int(scored[:, 1:].sum())
        loss = sft_loss(logps, scored[:, 1:])
        # 3. metrics: per step in training; token-weighted over the epoch in validation / test
        if stage == "train":
            self.num_tokens += int(self.trainer.strategy.reduce(batch["attention_mask"].sum(), reduce_op="sum"))
            metrics = {"loss": loss, "num_tokens": torch.tensor(float(self.num_tokens))}
            self.log_metrics(stage, metrics, batch_size=batch["input_ids"].shape[0])
        else:
            self.log_metrics(stage, {"loss": loss}, batch_size=max(1, n_scored))
        return loss

    def scored_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, L - 1) log-probs of the scored tokens of ``batch``'s rows, 0 elsewhere."""
        scored = batch["completion_mask"].bool() & batch["attention_mask"].bool()
        packed = None
        if batch.get("vision") is None and self.hparams.padding_free and scoring_path(self.policy).packed:
            packed = pack_rows(batch)
        return token_scores(self.policy, batch["input_ids"], batch["attention_mask"], scored, packed=packed,
                            vision=batch.get("vision")).logps  # fmt: skip

    def _log_perplexity(self, stage: str) -> None:
        """``<stage>/perplexity`` = exp of the epoch's token-weighted ``<stage>/loss`` (reduced across ranks)."""
        slot = f"{stage}__loss"
        if slot in self._epoch_metrics and self._epoch_metrics[slot].update_called:
            loss = float(self._epoch_metrics[slot].compute())
            self.log(f"{stage}/perplexity", math.exp(min(loss, 50.0)), on_epoch=True, batch_size=1)

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["sft_num_tokens"] = self.num_tokens

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.num_tokens = int(checkpoint.get("sft_num_tokens", 0))
