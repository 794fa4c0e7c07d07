"""Direct preference optimisation (Rafailov et al. 2023) and its variants as a LightningModule."""

from __future__ import annotations

from typing import Any

from aitraining_pl.losses import dpo_loss, loss_types, needs_reference
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.packing import (  # noqa: F401 - PackedBatch, can_pack, pack_batch: re-exported
    PackedBatch,
    can_pack,
    pack_batch,
    prompt_lengths,
)
from aitraining_pl.models.quantization import QuantizationConfig
from aitraining_pl.models.scoring import completion_logps  # noqa: F401 - re-exported
from aitraining_pl.modules.base import MODULE_RANGES
from aitraining_pl.modules.preference import (  # noqa: F401 - preference_accuracy: re-exported
    PreferenceModule,
    pair_metrics,
    preference_accuracy,
)
from aitraining_pl.optim import LRSchedule
from aitraining_pl.validation import constructor_arguments, renamed, rules


class DPOModule(PreferenceModule):
    """DPO and its variants (IPO, SLiC, robust and conservative DPO, SimPO, EXO, NCA, BCO, SPPO, AOT, APO, DiscoPOP,
    RPO as ``[sigmoid, sft]``) on preference batches.

    Args:
        model_name: folder or hub id of the policy (a causal LM).
        model_config: inline transformers config for a randomly initialised policy (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the policy (``LoRAConfig``); the reference is
            then the policy with adapters disabled.
        beta: temperature of the implicit reward ``beta * log(pi / pi_ref)``.
        loss_type: a loss of ``losses.DPO_LOSSES``: ``sigmoid`` (DPO), ``robust``, ``hinge`` (SLiC), ``ipo``,
            ``simpo``, ``exo_pair``, ``nca_pair``, ``bco_pair``, ``sppo_hard``, ``aot``, ``aot_unpaired``, ``apo_zero``,
            ``apo_down``, ``discopop``, ``sigmoid_norm``, ``sft`` (each cites its paper); or a list, whose losses are
            added with ``loss_weights`` (``[sigmoid, sft]`` is RPO).
        loss_weights: weight of each entry of a ``loss_type`` list (default: 1 each), as TRL's.
        label_smoothing: assumed label-flip rate for ``sigmoid`` (conservative DPO; TRL 1.16's sigmoid has none),
            ``robust``, ``aot`` and ``aot_unpaired``; EXO's epsilon for ``exo_pair``.
        reference_free: treat the reference as uniform (no reference model is loaded).
        simpo_gamma: target reward margin of SimPO.
        discopop_tau: temperature of DiscoPOP's mixing weight (``discopop``).
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
        precompute_ref_logps: deprecated spelling of ``precompute_ref_log_probs`` (TRL's name; accepted with a
            warning until the next release).
    """

    argument_ranges = {**MODULE_RANGES, **rules("beta", "loss_type", "label_smoothing", "simpo_gamma", "discopop_tau")}

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        beta: float = 0.1,
        loss_type: str | list[str] = "sigmoid",
        loss_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        simpo_gamma: float = 0.5,
        discopop_tau: float = 0.05,
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
        token_budget: int | None = None,
        freeze_vision_tower: bool = True,
        quantization: QuantizationConfig | None = None,
        precompute_ref_logps: bool | None = None,
    ):
        super().__init__()
        precompute_ref_log_probs = bool(
            renamed(
                type(self).__name__,
                "precompute_ref_log_probs",
                precompute_ref_log_probs,
                False,
                precompute_ref_logps=precompute_ref_logps,
            )
        )
        self.save_arguments(constructor_arguments(DPOModule.__init__, locals()))
        types = loss_types(loss_type)
        if loss_weights is not None and len(loss_weights) != len(types):
            raise ValueError(f"loss_weights has {len(loss_weights)} entries for {len(types)} loss types")
        self.build_models(needs_reference(types, reference_free))

    # ------------------------------------------------------------------ the loss
    def objective(self, policy, reference, batch, stage):
        hp = self.hparams
        chosen, rejected = policy.logps.chunk(2)
        chosen_len, rejected_len = policy.lengths.chunk(2)
        ref_chosen, ref_rejected = reference.chunk(2) if reference is not None else (None, None)
        out = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=hp.beta,
            loss_type=hp.loss_type,
            loss_weights=hp.loss_weights,
            label_smoothing=hp.label_smoothing,
            reference_free=hp.reference_free,
            chosen_lengths=chosen_len,
            rejected_lengths=rejected_len,
            gamma=hp.simpo_gamma,
            discopop_tau=hp.discopop_tau,
        )
        loss = out.losses.mean()
        metrics = {"loss": loss, **pair_metrics(out, chosen, rejected)}
        self.log_metrics(stage, metrics, batch_size=chosen.shape[0], prog_bar=("loss", "rewards/accuracies"))
        return loss
