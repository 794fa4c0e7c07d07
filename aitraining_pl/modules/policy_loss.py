"""The ``policy_loss`` argument group of the online RL modules (``losses.PolicyLossConfig``: GSPO's sequence-level
ratio, CISPO, the two-sided ``delta``, ``top_entropy_quantile``, ``mask_truncated_completions``), shared by
``PPOModule`` and ``CriticFreeModule`` through ``OnlineRLModule``."""

from __future__ import annotations

from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.losses import PolicyLossConfig, clipped_policy_loss, completed_rows, high_entropy_mask
from aitraining_pl.validation import OneOf, registry, rules

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
    # not the DPO losses of ``loss_type``; TRL's GRPO ``loss_type`` names an aggregation, ours is ``loss_aggregation``
    loss_type=OneOf(registry("aitraining_pl.losses", "POLICY_LOSSES"), hints=tuple(TRL_LOSS_TYPES.items())),
)


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
        (N, R): per-token weights of the policy term as well (the sampler correction of a vLLM rollout)."""
        hp, options = self.hparams, self.policy_loss
        quantile = options.top_entropy_quantile
        weights = high_entropy_mask(entropy, mask, quantile) if quantile < 1 else None  # Wang et al. 2025
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
