"""Critic-free online RL for language models: GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), DAPO's loss
options (Yu et al. 2025), RLOO (Ahmadian et al. 2024) and REINFORCE++ (Hu 2025), as one module on the
online-RL base (``modules/online.py``) that PPO shares; the algorithms differ only in the advantage estimator
(``losses.ADVANTAGE_ESTIMATORS``), the loss aggregation (``losses.LOSS_AGGREGATIONS``) and where the KL goes.

Each prompt gets ``num_generations`` responses; rewards are compared within the group, so no value model is
needed. The old, reference and policy forward passes run on the packed real tokens (``padding_free``) where the
batch has enough padding for packing to pay (``models.rollout_scoring.will_pack``), the LM head fused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses import (
    CRITIC_ESTIMATORS,
    PolicyLossConfig,
    clipped_policy_loss,
    compute_advantages,
    group_statistics,
    masked_mean,
    token_rewards,
)
from aitraining_pl.losses.advantages import CriticFreeAdvantage, ScaleRewards
from aitraining_pl.losses.policy_gradient import LossAggregation
from aitraining_pl.models import LoRAConfig
from aitraining_pl.models.quantization import QuantizationConfig
from aitraining_pl.models.training import eval_mode
from aitraining_pl.modules.online import ONLINE_RANGES, OnlineRLModule, RolloutBatch
from aitraining_pl.optim import LRSchedule
from aitraining_pl.rollout import GenerationConfig
from aitraining_pl.validation import constructor_arguments, rules


@dataclass
class PolicyExperience:
    """One rollout batch ready for the update; per-token tensors are (N, R)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    mask: torch.Tensor  #: response tokens that enter the loss (dropped groups zeroed)
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None  #: None when ``num_iterations == 1`` (the detached current ones are used)
    ref_logprobs: torch.Tensor | None  #: None unless the KL term is in the loss
    response_mask: torch.Tensor | None = None  #: sampled tokens (the entropy's mask; holes in an episode)
    is_weights: torch.Tensor | None = None  #: truncated importance weights of a vLLM rollout (``sampler_correction``)
    #: the sampler's log-probs when the correction is taken per micro-batch (one optimizer step: ``make_experience``)
    sampling_logprobs: torch.Tensor | None = None
    vision: Any = None  #: each row's images (``models.vision.VisionInputs``) for a VL model
    routes: torch.Tensor | None = None  #: (N, P + R, layers, k) an MoE sampler's routes, replayed (``policy_scores``)


class CriticFreeModule(OnlineRLModule):
    """Group-baseline policy-gradient RL with PPO-style clipping and no critic.

    Args:
        model_name: policy as a local folder or hub id.
        model_config: policy as an inline config dict (random init), instead of ``model_name``.
        tokenizer_name: tokenizer (default: ``model_name``; ``"byte"`` for the byte-level tokenizer).
        lora: LoRA adapters on the policy (``LoRAConfig``; the reference is then
            the policy with adapters disabled).
        reward: required: the reward source, as for ``PPOModule`` (import path, reward-model folder, class path,
            weighted components, an environment, or a Python callable
            ``(prompts, responses, metadata) -> list[float]``).
        generation: sampling settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_strings``).
        num_generations: responses sampled per prompt (the group size G).
        advantage: ``grpo`` (group mean and std), ``dr_grpo`` (group mean only), ``rloo`` (leave-one-out mean)
            or ``reinforce_pp`` (per-token returns, batch-normalised).
        scale_rewards: the std ``grpo`` divides by: ``group`` (GRPO), ``batch`` (the whole batch's, Liu et al.
            2025's recommendation) or ``none`` (no division, as ``dr_grpo``); TRL's option. Only for ``grpo``.
        loss_aggregation: ``sequence`` (mean per response, then over the responses with a token in the loss;
            GRPO), ``token`` (mean over all tokens; DAPO) or ``constant`` (sum / (rows x max_new_tokens); Dr. GRPO).
        learning_rate: peak AdamW learning rate (warmup by ``warmup_ratio``, then ``lr_schedule``).
        mini_batch_size: rollouts per forward/backward pass in the update.
        gradient_accumulation_steps: minibatches per optimizer step.
        token_budget: real tokens per forward/backward pass in the update (TRL's AsyncGRPO name; verl's
            ``ppo_max_token_len_per_gpu``): each minibatch of ``mini_batch_size`` rows is split into balanced
            micro-batches within it with the minibatch's loss and gradients (docs/
            long_context.md); a longer row is an error. ``null``: one pass per minibatch.
        balance_ranks: under data parallelism, deal each step's prompt groups to the ranks by their real tokens
            after sampling (verl's ``balance_batch``: Karmarkar-Karp, as many groups on every rank), so that no
            rank's update waits on another's longer rows; the rows move with ``all_to_all`` (docs/long_context.md).
            Not for multi-turn episodes, per-row images or sequence parallelism.
        num_iterations: passes over each rollout batch (old log-probs are computed only when > 1).
        epsilon: lower clip range of the ratio (``1 - epsilon``).
        epsilon_high: upper clip range (``1 + epsilon_high``; default ``epsilon``; DAPO's clip-higher: 0.28).
        kl_coef: KL(policy || reference) weight; 0 loads no reference model at all.
        kl_in_reward: put ``-kl_coef`` * k1 per token into the reward (RLOO, REINFORCE++) instead of
            ``kl_coef`` * k3 per token into the loss (GRPO).
        dynamic_sampling: DAPO's filter: groups whose rewards are all equal (no signal) leave the loss.
        policy_loss: TRL's further loss options (``PolicyLossConfig``): ``loss_type`` (``clip`` or CISPO's
            ``cispo``), ``importance_sampling_level`` (``token`` or GSPO's ``sequence``), ``delta`` (two-sided clip),
            ``top_entropy_quantile`` (only the highest-entropy tokens carry the policy term),
            ``mask_truncated_completions`` (responses cut at ``max_new_tokens`` leave the loss) and
            ``use_bias_correction_kl`` (the k3 KL term weighted by the importance ratio, DeepSeek-V3.2).
        max_grad_norm: gradient clipping by global norm (0 = off).
        missing_eos_penalty: subtracted from the score of responses that end without EOS or stop string.
        reward_timeout: seconds one call of the reward source may take; a call that does not return by then
            stops the run with a ``RewardError`` naming the source (``None``: no limit).
        padding_free: run the old, reference and policy forward passes on the packed real tokens, each group's
            prompt held once, when that holds at most three quarters of the padded batch's tokens
            (``models.packing.PACKING_THRESHOLD``, ``models.rollout_scoring.will_pack``).
        warmup_ratio: share of optimizer steps with linear warmup.
        seed: weight-initialisation seed of an inline ``model_config`` and of the minibatch order.
        dtype: dtype the models are loaded in (default: the checkpoint's).
        lr_schedule: decay after warmup: ``linear``, ``cosine`` or ``constant``.
        weight_decay: AdamW weight decay.
        trust_remote_code: allow custom model code from the hub (off by default).
        attn_implementation: attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``;
            default: transformers' choice, SDPA where supported).
        disable_dropout: set every dropout rate to 0 (policy, reference, reward model), as TRL does.
        gradient_checkpointing: recompute activations in backward instead of storing them (less memory, about a
            third more compute).
        freeze_vision_tower: a vision-language policy's vision encoder gets no gradients (its projector into the
            language model still trains, unless it sits inside the encoder, as Qwen VL's merger does); no effect
            on a text model.
        quantization: load the policy's base weights in 4 bits (QLoRA through bitsandbytes, ``QuantizationConfig``:
            ``{load_in_4bit: true, quant_type: nf4, compute_dtype: bfloat16}``); needs ``lora``. The reference is
            the same 4-bit base with the adapters off.
    """

    argument_ranges = {**ONLINE_RANGES, **rules("num_generations", "advantage", "scale_rewards", "loss_aggregation")}

    def __init__(
        self,
        model_name: str | None = None,
        model_config: dict[str, Any] | None = None,
        tokenizer_name: str | None = None,
        lora: LoRAConfig | None = None,
        reward: str | dict[str, Any] | Callable | None = None,
        generation: GenerationConfig = GenerationConfig(),
        num_generations: int = 8,
        advantage: CriticFreeAdvantage = "grpo",
        scale_rewards: ScaleRewards = "group",
        loss_aggregation: LossAggregation = "sequence",
        learning_rate: float = 1e-6,
        mini_batch_size: int = 8,
        gradient_accumulation_steps: int = 1,
        token_budget: int | None = None,
        balance_ranks: bool = False,
        num_iterations: int = 1,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        kl_coef: float = 0.04,
        kl_in_reward: bool = False,
        dynamic_sampling: bool = False,
        policy_loss: PolicyLossConfig = PolicyLossConfig(),
        max_grad_norm: float = 1.0,
        missing_eos_penalty: float | None = None,
        reward_timeout: float | None = 600.0,
        padding_free: bool = True,
        warmup_ratio: float = 0.0,
        seed: int = 0,
        dtype: str | None = None,
        lr_schedule: LRSchedule = "linear",
        weight_decay: float = 0.0,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        freeze_vision_tower: bool = True,
        quantization: QuantizationConfig | None = None,
    ):
        super().__init__()
        if advantage in CRITIC_ESTIMATORS:
            raise ValueError(f"advantage {advantage!r} needs a critic: use PPOModule")
        compute_advantages(advantage, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, dtype=torch.long))  # known?
        clipped_policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), aggregation=loss_aggregation
        )
        self.setup_online(constructor_arguments(CriticFreeModule.__init__, locals()))
        if scale_rewards != "group" and advantage != "grpo":
            raise ConfigError(f"{type(self).__name__}.scale_rewards", f"applies to advantage 'grpo', not {advantage!r}")
        if self.policy_loss.use_bias_correction_kl and (not kl_coef or kl_in_reward):
            raise ConfigError(
                f"{type(self).__name__}.policy_loss.use_bias_correction_kl",
                "weights the k3 KL term of the loss: needs kl_coef > 0 and kl_in_reward: false",
            )
        self.model, self.reference = self.load_policy_from_hparams(with_reference=bool(kl_coef))
        if self.reference is not None and not self.reference.shares_weights:
            rank_zero_info(
                f"{type(self).__name__}: kl_coef={kl_coef} loads a frozen copy of the policy as the KL reference (a "
                "second full model in memory); kl_coef: 0 (TRL's default) loads none, LoRA shares the base weights"
            )
        reference = self.reference.model if self.reference is not None else None
        self.apply_training_options(reference, getattr(self.reward_source, "model", self.reward_source))

    @property
    def policy(self) -> torch.nn.Module:
        """The language model being trained (peft model under LoRA); exported by ``save_pretrained``."""
        return self.model

    # ------------------------------------------------------------------ log-prob passes
    @torch.no_grad()
    def frozen_logprobs(self, rollout: RolloutBatch, reference: bool) -> torch.Tensor:
        """(N, R) log-probs of the policy (eval mode) or of the reference, a run of rows at a time (``row_chunks``)."""
        ids, attention, P = rollout.input_ids, rollout.attention_mask, rollout.prompt_length
        vision = lambda r: self.vision_rows(rollout.vision, r)  # noqa: E731
        if reference:
            return torch.cat(
                self.in_minibatches(
                    lambda r: self.reference_logprobs(ids[r], attention[r], P, vision(r)), len(ids), attention
                )
            )
        routes = lambda r: None if rollout.routes is None else rollout.routes[r]  # noqa: E731
        scores = lambda r: self.policy_scores(ids[r], attention[r], P, vision=vision(r), routes=routes(r))  # noqa: E731
        with eval_mode(self.policy):
            return torch.cat(self.in_minibatches(lambda r: scores(r)[0].logprobs, len(ids), attention))

    # ------------------------------------------------------------------ one iteration (steps in OnlineRLModule)
    @property
    def has_reference(self) -> bool:
        """Whether a reference scores the rollouts (``reference_logprobs``; a subclass may score with another)."""
        return self.reference is not None

    def deferred_correction(self, rollout: RolloutBatch) -> bool:
        """Whether the sampler correction is taken in each micro-batch instead of against a separate pi_old pass: a
        sampler's rollout (vLLM, a generation server), one optimizer step per iteration (its micro-batches all before
        it) and no old log-probs otherwise needed; its micro-batches' current (detached) log-probs are pi_old's then
        (the same weights, the same numbers)."""
        hp = self.hparams
        one_step = (
            hp.num_iterations == 1 and rollout.input_ids.shape[0] == hp.mini_batch_size * hp.gradient_accumulation_steps
        )
        kl_in_reward = bool(self.kl_coef) and hp.kl_in_reward
        return rollout.sampling_logprobs is not None and one_step and not kl_in_reward

    def frozen_passes(self, rollout: RolloutBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(N, R) old and reference log-probs of ``rollout``, each only where the update needs it (else None)."""
        hp = self.hparams
        kl_in_reward = bool(self.kl_coef) and hp.kl_in_reward
        sampled, deferred = rollout.sampling_logprobs is not None, self.deferred_correction(rollout)
        need_old = hp.num_iterations > 1 or kl_in_reward or (sampled and not deferred)
        old = self.frozen_logprobs(rollout, reference=False) if need_old else None
        ref = self.frozen_logprobs(rollout, reference=True) if self.has_reference and self.kl_coef else None
        return old, ref

    def make_experience(self, rollout: RolloutBatch) -> tuple[PolicyExperience, dict[str, torch.Tensor]]:
        """The experience of ``rollout`` from its old / reference log-probs (``frozen_passes``, ``experience``)."""
        return self.experience(rollout, *self.frozen_passes(rollout))

    def experience(
        self, rollout: RolloutBatch, old: torch.Tensor | None, ref: torch.Tensor | None
    ) -> tuple[PolicyExperience, dict[str, torch.Tensor]]:
        """Token rewards (score, minus k1 KL when in the reward), the registered advantages (``scale_rewards`` for
        ``grpo``), DAPO's filter of groups with no signal and of truncated responses
        (``policy_loss.mask_truncated_completions``), given the old and reference log-probs."""
        hp, mask, stats = self.hparams, rollout.mask, {}
        kl_in_reward = bool(self.kl_coef) and hp.kl_in_reward
        deferred = self.deferred_correction(rollout)
        weights, stats = (None, {}) if deferred else self.sampler_correction(old, rollout.sampling_logprobs, mask)
        if kl_in_reward:
            rewards, kl = token_rewards(rollout.scores, old, ref, mask, self.kl_coef, "k1", rollout.token_scores)
            stats["kl"] = kl.sum(1).mean()
        else:
            rewards = rollout.placed_scores()
        scaling = {"scale_rewards": hp.scale_rewards} if hp.advantage == "grpo" else {}
        advantages = compute_advantages(hp.advantage, rewards, mask, rollout.group, episode=rollout.episode, **scaling)
        loss_mask = mask
        if hp.dynamic_sampling:
            count, _, std = group_statistics(rollout.scores, rollout.group)
            loss_mask = mask * ((std > 0) & (count > 1)).to(mask.dtype).unsqueeze(1)
        loss_mask = self.loss_mask(loss_mask, rollout.ended)
        experience = PolicyExperience(
            rollout.input_ids,
            rollout.attention_mask,
            rollout.prompt_length,
            loss_mask,
            advantages,
            old if hp.num_iterations > 1 else None,
            None if kl_in_reward else ref,
            mask,
            weights,
            rollout.sampling_logprobs if deferred else None,
            rollout.vision,
            rollout.routes,
        )
        return experience, stats

    def share_aggregation(self) -> str:
        """``loss_aggregation``: what weighs a micro-batch's loss in its minibatch's (``token_budget``)."""
        return self.hparams.loss_aggregation

    def minibatch_loss(self, exp: PolicyExperience, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped policy-gradient loss on rollouts ``idx`` (plus ``kl_coef`` * k3 when the KL is in the loss)."""
        hp = self.hparams
        mask = exp.mask[idx]
        vision = self.vision_rows(exp.vision, idx)
        out, routing = self.policy_scores(
            exp.input_ids[idx],
            exp.attention_mask[idx],
            exp.prompt_length,
            with_entropy=True,
            vision=vision,
            routes=None if exp.routes is None else exp.routes[idx],
        )
        old = exp.old_logprobs[idx] if exp.old_logprobs is not None else out.logprobs.detach()
        ref = exp.ref_logprobs[idx] if exp.ref_logprobs is not None else None
        is_weights = exp.is_weights[idx] if exp.is_weights is not None else None  # vLLM rollouts (Yao et al. 2025)
        sampling = {}
        if exp.sampling_logprobs is not None:  # the correction deferred to here (``make_experience``)
            is_weights, sampling = self.sampler_correction(
                out.logprobs.detach(), exp.sampling_logprobs[idx], exp.response_mask[idx]
            )
        loss, stats = self.policy_gradient_loss(
            out.logprobs, out.entropy, old, exp.advantages[idx], mask, hp.loss_aggregation, ref, is_weights
        )
        return loss, {  # an MoE config's router auxiliary loss, ``routing/aux_loss``: added by ``minibatch_backward``
            **routing,
            "loss": loss.detach(),
            "entropy": masked_mean(out.entropy.detach(), exp.response_mask[idx]),
            **stats,
            **sampling,
        }


class GRPOModule(CriticFreeModule):
    """GRPO (Shao et al. 2024): group-normalised advantages, per-response mean loss, k3 KL in the loss.
    Arguments as ``CriticFreeModule``; for Dr. GRPO set ``advantage: dr_grpo`` and ``loss_aggregation: constant``,
    for DAPO ``loss_aggregation: token``, ``epsilon_high: 0.28``, ``dynamic_sampling: true``, ``kl_coef: 0``
    (and ``policy_loss: {mask_truncated_completions: true}``), for GSPO ``policy_loss: {importance_sampling_level:
    sequence}`` with ``epsilon: 3.0e-4``, ``epsilon_high: 4.0e-4``, ``kl_coef: 0``, for CISPO ``policy_loss:
    {loss_type: cispo}`` with ``epsilon_high: 4.0`` (TRL's ``epsilon_high: 5.0``: TRL's bound is ``epsilon_high``,
    ours ``1 + epsilon_high``).

    Args:
        advantage: advantage estimator (default ``grpo``).
        loss_aggregation: loss aggregation (default ``sequence``).
        kl_coef: weight of the k3 KL term in the loss. The default 0.04 (DeepSeekMath's) loads a frozen copy of the
            policy as the reference, a second full model in memory (under LoRA the base with adapters off instead);
            0, TRL's default (``beta=0.0``), loads no reference.
    """

    def __init__(
        self,
        advantage: CriticFreeAdvantage = "grpo",
        loss_aggregation: LossAggregation = "sequence",
        kl_coef: float = 0.04,
        **kwargs: Any,
    ):
        super().__init__(advantage=advantage, loss_aggregation=loss_aggregation, kl_coef=kl_coef, **kwargs)


class RLOOModule(CriticFreeModule):
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, k1 KL in the reward (as in the paper and TRL),
    token-mean loss. Arguments as ``CriticFreeModule``.

    Args:
        advantage: advantage estimator (default ``rloo``).
        loss_aggregation: loss aggregation (default ``token``).
        kl_coef: weight of the per-token k1 KL penalty in the reward.
        kl_in_reward: KL in the reward (default) or as k3 in the loss.
    """

    def __init__(
        self,
        advantage: CriticFreeAdvantage = "rloo",
        loss_aggregation: LossAggregation = "token",
        kl_coef: float = 0.05,
        kl_in_reward: bool = True,
        **kwargs: Any,
    ):
        super().__init__(
            advantage=advantage, loss_aggregation=loss_aggregation, kl_coef=kl_coef, kl_in_reward=kl_in_reward, **kwargs
        )
