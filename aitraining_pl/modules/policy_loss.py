"""The ``policy_loss`` argument group of the online RL modules (``losses.PolicyLossConfig``: GSPO's sequence-level
ratio, CISPO, the two-sided ``delta``, ``top_entropy_quantile``, ``mask_truncated_completions``, the sampler / trainer
correction ``importance_sampling_mode``), shared by ``PPOModule`` and ``CriticFreeModule`` through
``OnlineRLModule``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.losses import PolicyLossConfig, clipped_policy_loss, completed_rows, high_entropy_mask
from aitraining_pl.validation import OneOf, registry, replaced, rules

#: TRL's GRPO ``loss_type`` values that are an aggregation here (``loss_aggregation``; docs/from_trl.md)
TRL_LOSS_TYPES = {
    name: f"TRL's loss_type {name!r} is loss_aggregation: {aggregation} here; policy_loss.loss_type is the surrogate"
    for name, aggregation in {"grpo": "sequence", "bnpo": "token", "dapo": "token", "dr_grpo": "constant"}.items()
}

#: allowed values of the ``policy_loss`` group's fields (``PolicyLossConfig`` sits in ``losses``, below validation).
POLICY_LOSS_RANGES = rules(
    "importance_sampling_level",
    "delta",
    "top_entropy_quantile",
    "importance_sampling_mode",
    "importance_sampling_clip_min",
    "importance_sampling_clip_max",
    # not the DPO losses of ``loss_type``; TRL's GRPO ``loss_type`` names an aggregation, ours is ``loss_aggregation``
    loss_type=OneOf(registry("aitraining_pl.losses", "POLICY_LOSSES"), hints=tuple(TRL_LOSS_TYPES.items())),
)


#: ``generation.vllm.importance_sampling_correction`` (deprecated) -> ``policy_loss.importance_sampling_mode``
OLD_CORRECTION = {True: "token_truncate", False: "none", "auto": "auto"}
OLD_CAP = 2.0  #: the default of the deprecated ``generation.vllm.importance_sampling_cap``


def moved_correction(
    options: PolicyLossConfig, generation: GenerationConfig, owner: str
) -> tuple[PolicyLossConfig, GenerationConfig]:
    """``options`` and ``generation`` with the deprecated ``generation.vllm.importance_sampling_correction`` /
    ``importance_sampling_cap`` moved to ``policy_loss.importance_sampling_mode`` / ``importance_sampling_clip_max``
    (a ``RenamedArgumentWarning`` each; a ``ConfigError`` when both spellings are given). ``correction: true`` without
    a cap keeps the old cap, 2.0, so an old config trains as before; the old defaults (``auto``, 2.0: the hparams of a
    checkpoint written before) are dropped silently. Copies; the arguments are not changed."""
    correction, cap = generation.vllm.importance_sampling_correction, generation.vllm.importance_sampling_cap
    if correction is None and cap is None:
        return options, generation
    if correction == "auto" and cap == OLD_CAP:  # the old defaults, as saved in the hparams of earlier runs: dropped
        correction = cap = None
    defaults, changes = PolicyLossConfig(), {}
    for old, new, value in (
        ("importance_sampling_correction", "importance_sampling_mode", OLD_CORRECTION.get(correction, correction)),
        ("importance_sampling_cap", "importance_sampling_clip_max", cap),
    ):
        if value is None:
            continue
        if getattr(options, new) != getattr(defaults, new):
            raise ConfigError(f"{owner}.policy_loss.{new}", f"given twice: as {new!r} and as generation.vllm.{old!r}")
        replaced(owner, f"generation.vllm.{old}", f"policy_loss.{new}")
        changes[new] = value
    if correction is True and "importance_sampling_clip_max" not in changes:
        clip_max = options.importance_sampling_clip_max
        changes["importance_sampling_clip_max"] = (
            OLD_CAP if clip_max == defaults.importance_sampling_clip_max else clip_max
        )
    vllm = dataclasses.replace(generation.vllm, importance_sampling_correction=None, importance_sampling_cap=None)
    return dataclasses.replace(options, **changes), dataclasses.replace(generation, vllm=vllm)


class PolicyLossOptions:
    """Mixin of ``OnlineRLModule``: reads ``epsilon``, ``epsilon_high`` from ``hparams``, ``kl_coef`` and
    ``generation`` from the module."""

    policy_loss: PolicyLossConfig = PolicyLossConfig()

    @staticmethod
    def policy_loss_options(policy_loss: Any) -> PolicyLossConfig:
        """``policy_loss`` (a ``PolicyLossConfig`` or a dict, as stored in hparams) as a ``PolicyLossConfig``."""
        return policy_loss if isinstance(policy_loss, PolicyLossConfig) else PolicyLossConfig(**dict(policy_loss))

    def set_policy_loss(self, options: PolicyLossConfig, sequence_level: bool = True) -> None:
        """Keep ``options`` as ``self.policy_loss``; refuse combinations that do not apply (``sequence_level=False``:
        per-token advantages, GSPO does not apply)."""
        owner = f"{type(self).__name__}.policy_loss"
        if options.loss_type == "cispo" and options.delta is not None:
            raise ConfigError(f"{owner}.delta", "bounds the clipped surrogate; cispo clips its own weight")
        if not sequence_level and options.importance_sampling_level != "token":
            raise ConfigError(f"{owner}.importance_sampling_level", "sequence needs one advantage per response (GSPO)")
        low, high = options.importance_sampling_clip_min, options.importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ConfigError(f"{owner}.importance_sampling_clip_min", f"must be below clip_max ({high}), got {low}")
        if options.importance_sampling_mode.endswith("_truncate") and not low and high is None:
            raise ConfigError(f"{owner}.importance_sampling_clip_max", "a truncate mode needs a bound (min or max)")
        if not options.use_decoupled_loss and options.importance_sampling_mode not in ("auto", "none"):
            raise ConfigError(
                f"{owner}.importance_sampling_mode", "the coupled loss (use_decoupled_loss: false) takes no weight"
            )
        self.policy_loss = options

    def loss_mask(self, mask: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
        """``mask`` without the truncated responses when ``mask_truncated_completions`` (DAPO), else ``mask``."""
        return completed_rows(mask, ended) if self.policy_loss.mask_truncated_completions else mask

    def policy_gradient_loss(
        self,
        logprobs: torch.Tensor,
        entropy: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        aggregation: str,
        ref_logprobs: torch.Tensor | None = None,
        is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``losses.clipped_policy_loss`` with the module's clip range, KL weight and ``policy_loss`` options; with
        ``top_entropy_quantile < 1`` only the highest-entropy tokens of ``mask`` carry the policy term. ``is_weights``
        (N, R): per-token weights of the policy term as well (``sampler_correction``: the importance weights of
        ``pi_old / pi_sampler``; with the ratio's clip around ``pi_old`` this is AReaL's decoupled PPO). With
        ``use_decoupled_loss: false`` they are the plain ratio ``pi_old / pi_sampler`` and move into the ratio instead:
        ``pi_theta / pi_sampler``, clipped (the coupled objective)."""
        hp, options = self.hparams, self.policy_loss
        quantile = options.top_entropy_quantile
        weights = high_entropy_mask(entropy, mask, quantile) if quantile < 1 else None  # Wang et al. 2025
        if is_weights is not None and not options.use_decoupled_loss:  # coupled: pi_theta / pi_b inside the clip
            old_logprobs, is_weights = old_logprobs - torch.log(is_weights), None  # is_weights: pi_old / pi_b
        if is_weights is not None:
            weights = is_weights if weights is None else weights * is_weights
        return clipped_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            hp.epsilon,
            hp.epsilon_high,
            aggregation,
            self.generation.max_new_tokens,
            ref_logprobs,
            self.kl_coef,
            loss_type=options.loss_type,
            importance_sampling_level=options.importance_sampling_level,
            delta=options.delta,
            token_weights=weights,
            use_bias_correction_kl=options.use_bias_correction_kl,
        )
