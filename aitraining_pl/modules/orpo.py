"""Reference-free preference optimisation: ORPO (Hong et al. 2024) and CPO (Xu et al. 2024) as LightningModules.

Both train on the preference batches of ``PreferenceDataModule`` with no reference model: a supervised term on
the chosen completion plus a term that separates chosen from rejected, which is why they can start from a base
model without an SFT stage (ORPO) or need no reference copy in memory (both).
"""

from __future__ import annotations

from typing import Any

import torch

from aitraining_pl.losses import DPOOutput, SequenceLogps, dpo_loss, orpo_loss
from aitraining_pl.losses.preference import DPOLossType
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.micro_batches import budgeted_forward
from aitraining_pl.models.quantization import QuantizationConfig
from aitraining_pl.models.scoring import is_contiguous, pack_rows, scoring_path, token_logps
from aitraining_pl.modules.base import MODULE_RANGES
from aitraining_pl.modules.preference import PreferenceModule, pair_metrics
from aitraining_pl.optim import LRSchedule
from aitraining_pl.validation import constructor_arguments, rules


def chosen_nll(chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per chosen completion token over the batch (the SFT term of ORPO and CPO)."""
    return -chosen_logps.sum() / chosen_lengths.sum().clamp_min(1)


def logps_with_chosen_prompts(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], padding_free: bool
) -> tuple[SequenceLogps, SequenceLogps]:
    """One forward scoring the completions of all 2B rows and, in the B chosen rows, the prompt tokens too.

    Returns:
        ``(completions, chosen_rows)``: the (2B,) summed completion log-probs with their token counts (as
        ``models.scoring.completion_logps``), and the (B,) summed log-probs of every real token of each chosen
        row but the first (prompt and completion: TRL's ORPO NLL) with their counts. ``padding_free`` packs one
        block per row (``pack_rows``); a prompt is not shared between the rows of a pair.
    """
    b = batch["input_ids"].shape[0] // 2
    completion, real = batch["completion_mask"], batch["attention_mask"]
    scored = torch.cat([real[:b], completion[b:]]).to(completion.dtype)
    packed = None
    if padding_free and scoring_path(model).packed and is_contiguous(batch):
        packed = pack_rows({**batch, "completion_mask": scored})
    token = token_logps(model, batch["input_ids"], real, scored, packed=packed)
    completion = completion[:, 1:].to(token.dtype)
    completions = SequenceLogps((token * completion).sum(-1), completion.sum(-1))
    return completions, SequenceLogps(token[:b].sum(-1), scored[:b, 1:].sum(-1).to(token.dtype))


class ORPOModule(PreferenceModule):
    """ORPO, odds-ratio preference optimisation (Hong et al. 2024): with ``p`` the per-token average probability
    of a completion, ``loss = NLL(chosen) - beta * log s(log odds(chosen) - log odds(rejected))``, where
    ``odds = p / (1 - p)`` (``losses.orpo_loss``). Reference-free. The NLL is the mean over the chosen
    completions' tokens (``disable_prompt_loss: true``, the default) or over the chosen rows' prompt and completion
    tokens (``false``: TRL 1.16's ORPO and the original ORPO code's default); the odds always use the completions.

    Metrics (``train/``, ``val/``): ``loss``, ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen`` and TRL's
    pair metrics, with ``rewards/*`` = ``beta`` times the average token log-prob of each completion.

    Args:
        model_name: folder or hub id of the policy (a causal LM).
        model_config: inline transformers config for a randomly initialised policy (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the policy (``LoRAConfig``).
        beta: weight of the odds-ratio term (the paper's lambda; TRL's ``beta``).
        disable_prompt_loss: the NLL term on the chosen completion's tokens only (default: the paper's
            ``-log P(y_w | x)``, as CPO's and RPO's NLL); ``false`` averages it over the chosen rows' prompt and
            completion tokens, as TRL 1.16 does (the original ORPO code's option); ``share_prompt`` then does not
            apply (each row is scored on its own).
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        padding_free: run the batch's real tokens packed end to end in one row (as ``DPOModule``'s).
        share_prompt: pack each pair as one sequence holding its prompt once (as ``DPOModule``'s).
        dtype: weights dtype when loading (``bfloat16``, ``float32``, ...; default: as stored / float32).
        seed: seed of the random initialisation when ``model_config`` is used.
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (default: transformers' choice).
        disable_dropout: set every dropout rate to 0, as TRL does.
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

    argument_ranges = {**MODULE_RANGES, **rules("beta")}

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        beta: float = 0.1,
        disable_prompt_loss: bool = True,
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
        self.save_arguments(constructor_arguments(ORPOModule.__init__, locals()))
        self.build_models(uses_reference=False)

    def shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """As ``PreferenceModule``'s; with ``disable_prompt_loss: false`` the same forward also scores the chosen
        rows' prompt tokens, for the NLL."""
        if self.hparam("disable_prompt_loss", True):
            return super().shared_step(batch, stage)
        hp = self.hparams
        score = lambda rows: logps_with_chosen_prompts(self.policy, rows, hp.padding_free or hp.share_prompt)  # noqa: E731
        policy, chosen_rows = budgeted_forward(score, batch, hp.token_budget, paired=True)
        return self.objective(policy, None, batch, stage, nll=chosen_nll(chosen_rows.logps, chosen_rows.lengths))

    def objective(self, policy, reference, batch, stage, nll: torch.Tensor | None = None):
        """``nll``: the NLL term when it is not the chosen completions' (``disable_prompt_loss: false``)."""
        chosen, rejected = policy.logps.chunk(2)
        chosen_len, rejected_len = (n.clamp_min(1) for n in policy.lengths.chunk(2))
        chosen_avg, rejected_avg = chosen / chosen_len, rejected / rejected_len
        nll = chosen_nll(chosen, chosen_len) if nll is None else nll
        out = orpo_loss(chosen_avg, rejected_avg, nll, self.hparams.beta)
        loss = out.losses.mean()
        beta = self.hparams.beta
        rewards = DPOOutput(out.losses, (beta * chosen_avg).detach(), (beta * rejected_avg).detach())
        metrics = {
            "loss": loss,
            "nll_loss": nll,
            "log_odds_ratio": out.log_odds_ratio,
            "log_odds_chosen": out.log_odds,
            **pair_metrics(rewards, chosen, rejected),
        }
        self.log_metrics(stage, metrics, batch_size=chosen.shape[0], prog_bar=("loss", "rewards/accuracies"))
        return loss


class CPOModule(PreferenceModule):
    """CPO, contrastive preference optimisation (Xu et al. 2024): a DPO-family loss with the reference taken as
    uniform, plus ``cpo_alpha`` times the chosen completions' token NLL: ``-log s(beta (log pi(w) - log pi(l))) +
    alpha * NLL(w)`` for the default ``sigmoid`` (``losses.dpo_loss`` with ``reference_free=True`` and
    ``loss_type=[loss_type, "sft"]``). With ``loss_type: simpo`` it is CPO-SimPO.

    Metrics: ``loss``, ``nll_loss`` and TRL's pair metrics (``rewards/*`` = ``beta`` times the log-probs).

    Args:
        model_name: folder or hub id of the policy (a causal LM).
        model_config: inline transformers config for a randomly initialised policy (instead of ``model_name``).
        tokenizer_name: tokenizer folder, hub id or ``"byte"`` (default: ``model_name``); shared with the data.
        lora: LoRA adapters on the policy (``LoRAConfig``).
        beta: temperature of the preference term.
        loss_type: the preference term, a loss of ``losses.DPO_LOSSES`` (TRL's CPO: ``sigmoid``, ``hinge``,
            ``ipo``, ``simpo``).
        cpo_alpha: weight of the chosen NLL term (TRL's ``cpo_alpha``; 0 leaves only the preference term).
        label_smoothing: assumed label-flip rate of ``sigmoid`` / ``robust`` (as ``DPOModule``'s).
        simpo_gamma: target reward margin of ``simpo``.
        learning_rate: peak AdamW learning rate.
        warmup_ratio: fraction of the optimizer steps spent in linear warmup.
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        padding_free: run the batch's real tokens packed end to end in one row (as ``DPOModule``'s).
        share_prompt: pack each pair as one sequence holding its prompt once (as ``DPOModule``'s).
        dtype: weights dtype when loading (``bfloat16``, ``float32``, ...; default: as stored / float32).
        seed: seed of the random initialisation when ``model_config`` is used.
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (default: transformers' choice).
        disable_dropout: set every dropout rate to 0, as TRL does.
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

    argument_ranges = {**MODULE_RANGES, **rules("beta", "loss_type", "cpo_alpha", "label_smoothing", "simpo_gamma")}

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        beta: float = 0.1,
        loss_type: DPOLossType = "sigmoid",
        cpo_alpha: float = 1.0,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
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
        self.save_arguments(constructor_arguments(CPOModule.__init__, locals()))
        self.build_models(uses_reference=False)

    def objective(self, policy, reference, batch, stage):
        hp = self.hparams
        chosen, rejected = policy.logps.chunk(2)
        chosen_len, rejected_len = policy.lengths.chunk(2)
        out = dpo_loss(
            chosen,
            rejected,
            None,
            None,
            beta=hp.beta,
            loss_type=[hp.loss_type, "sft"],
            loss_weights=[1.0, hp.cpo_alpha],
            label_smoothing=hp.label_smoothing,
            reference_free=True,
            chosen_lengths=chosen_len,
            rejected_lengths=rejected_len,
            gamma=hp.simpo_gamma,
        )
        loss = out.losses.mean()
        metrics = {"loss": loss, "nll_loss": chosen_nll(chosen, chosen_len), **pair_metrics(out, chosen, rejected)}
        self.log_metrics(stage, metrics, batch_size=chosen.shape[0], prog_bar=("loss", "rewards/accuracies"))
        return loss
