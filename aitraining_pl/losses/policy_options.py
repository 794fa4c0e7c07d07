"""Options of the online policy-gradient loss that TRL, OpenRLHF and verl users set: where the importance ratio is
taken, what the surrogate is, which tokens enter the loss. Each is a small pure function or registry entry that
``policy_gradient.clipped_policy_loss`` composes; ``PolicyLossConfig`` groups them as one module argument.

- ``importance_sampling_level`` (``IMPORTANCE_SAMPLING_LEVELS``): ``token`` (PPO / GRPO, one ratio per token) or
  ``sequence`` (GSPO, Zheng et al. 2025: ``s_i = exp(mean_t (logp - old_logp))``, the length-normalised sequence
  ratio, clipped per response).
- ``loss_type`` (``POLICY_LOSSES``): ``clip`` (PPO's clipped surrogate, Schulman et al. 2017, with an optional
  upper bound ``delta`` on the unclipped ratio, the two-sided / dual clip of INTELLECT-2 and TRL's ``delta``) or
  ``cispo`` (MiniMax-M1, 2025: REINFORCE weighted by a clipped, stop-gradient importance weight, so no token's
  gradient is dropped).
- ``top_entropy_quantile`` (``high_entropy_mask``): only the highest-entropy share of the response tokens carries
  the policy term (Wang et al. 2025, "Beyond the 80/20 rule").
- ``mask_truncated_completions`` (``completed_rows``): responses cut at ``max_new_tokens`` leave the loss (DAPO,
  Yu et al. 2025).
- ``use_bias_correction_kl``: the k3 KL term weighted by the importance ratio (DeepSeek-V3.2, 2025; applied in
  ``policy_gradient.clipped_policy_loss``).
- ``importance_sampling_mode``, ``importance_sampling_clip_min`` / ``_max`` (``off_policy.IMPORTANCE_SAMPLING_MODES``):
  the correction for the gap between the policy that sampled and the trainer (TRL's ``vllm_importance_sampling_*``),
  and ``use_decoupled_loss`` (AReaL's name): whether the clip is around the trainer's log-probs (decoupled) or the
  sampler's (coupled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO / GRPO: the per-token log-ratio ``logp_t - old_logp_t``, (N, R)."""
    return logprobs - old_logprobs


def sequence_log_ratio_mean(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, eq. 7): ``log s_i = (1/|y_i|) sum_t (logp_t - old_logp_t)`` over the response's
    tokens, the same value on every token of the row, (N, R). A constant per-token log-ratio ``c`` gives ``c``
    whatever the length; a row with no token in the mask gives 0."""
    mask = mask.to(logprobs.dtype)
    mean = ((logprobs - old_logprobs) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1.0)
    return mean.expand_as(logprobs)


#: The ``importance_sampling_level`` values, as a type; equal to the keys of ``IMPORTANCE_SAMPLING_LEVELS`` (tested).
ImportanceSamplingLevel = Literal["token", "sequence"]

IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio_mean,
}


def clipped_surrogate(
    ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate per token, ``max(-A min(rho, delta), -A clip(rho, 1 - eps, 1 + eps_high))``.

    ``delta`` (TRL's ``delta``; INTELLECT-2's two-sided clipping) bounds the unclipped ratio too, so a token with
    a negative advantage whose ratio has grown large cannot make the loss unbounded (PPO clips that side only
    for positive advantages). ``None``: no bound (plain PPO)."""
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return torch.maximum(-advantages * unclipped, -advantages * torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high))


def cispo_surrogate(
    ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """CISPO (MiniMax-M1, 2025, eq. 4): ``-sg(min(rho, 1 + eps_high)) * A * logp`` per token: the REINFORCE term
    weighted by the importance ratio clipped from above and detached, so every token keeps a gradient (the
    paper sets no lower bound). TRL bounds the ratio by ``epsilon_high`` itself (its recommended 5.0 is this
    project's ``epsilon_high: 4.0``). ``epsilon`` and ``delta`` do not apply."""
    weight = torch.clamp(ratio, max=1 + epsilon_high).detach()
    return -weight * advantages * logprobs


#: The ``loss_type`` values of the online policy loss, as a type; equal to the keys of ``POLICY_LOSSES`` (tested).
PolicyLossType = Literal["clip", "cispo"]

POLICY_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "clip": clipped_surrogate,
    "cispo": cispo_surrogate,
}


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Wang et al. 2025 ("Beyond the 80/20 rule"): 1 on the tokens whose entropy is at or above the
    ``1 - quantile`` quantile of the entropies inside ``mask`` (linear interpolation, ``torch.quantile``), 0
    elsewhere; ``quantile = 1`` keeps every token of the mask (as TRL's ``top_entropy_quantile``).

    Args:
        entropy: (N, R) per-token entropies. mask: (N, R) tokens to rank. quantile: share kept, in (0, 1].

    Returns:
        (N, R) float mask, a subset of ``mask``.
    """
    mask = mask.to(entropy.dtype)
    if quantile >= 1.0 or not mask.any():
        return mask
    values = entropy.detach().float()[mask.bool()]
    threshold = torch.quantile(values, 1.0 - quantile).to(entropy.dtype)
    return ((entropy.detach() >= threshold).to(mask.dtype)) * mask


def completed_rows(mask: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filter (Yu et al. 2025; TRL's ``mask_truncated_completions``): ``mask`` with the rows of
    responses that did not end (cut at ``max_new_tokens``) zeroed. mask: (N, R); ended: (N,) bool."""
    return mask * ended.to(mask.dtype).unsqueeze(1)


#: The ``importance_sampling_mode`` values: the keys of ``off_policy.IMPORTANCE_SAMPLING_MODES`` (tested), ``none`` and
#: ``auto`` (``PolicyLossConfig.off_policy_mode``).
ImportanceSamplingMode = Literal["auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass
class PolicyLossConfig:
    """Options of the policy loss beyond PPO's clip (TRL's ``GRPOConfig`` names); the defaults are plain GRPO.

    Args:
        loss_type: ``clip`` (PPO's clipped surrogate) or ``cispo`` (MiniMax-M1: clipped, stop-gradient importance
            weight on the REINFORCE term; the weight is bounded by ``1 + epsilon_high``, e.g. ``epsilon_high: 4.0``,
            which is TRL's ``epsilon_high: 5.0``: TRL bounds it by ``epsilon_high``).
        importance_sampling_level: ``token`` (one ratio per token) or ``sequence`` (GSPO: the length-normalised
            sequence ratio, clipped per response; GSPO uses ``epsilon: 3e-4``, ``epsilon_high: 4e-4``).
        delta: upper bound on the unclipped ratio for every advantage sign (two-sided clip; TRL's ``delta``;
            ``null``: none). Must be above 1; INTELLECT-2 uses 4.
        top_entropy_quantile: share of the response tokens, the highest-entropy ones, that carry the policy term
            (Wang et al. 2025 keep 0.2); 1.0 keeps all.
        mask_truncated_completions: responses cut at ``max_new_tokens`` leave the loss (DAPO). With
            ``loss_aggregation: sequence`` the mean is over the responses left (TRL averages over all of them).
        use_bias_correction_kl: multiply each token's k3 KL term by the importance ratio ``pi_theta / pi_old``
            (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``, default ``true`` there): the KL term's gradient becomes
            the unbiased gradient of KL(policy || reference). Off by default (GRPO's plain k3, Shao et al. 2024).
            Needs the KL term in the loss (``kl_coef > 0``, ``kl_in_reward: false``).
        importance_sampling_mode: how a rollout that carries the sampler's log-probs (vLLM, a generation server,
            stale weights) is corrected for the gap between the sampler ``pi_b`` and the trainer's ``pi_old``
            (``losses.off_policy``; TRL's ``vllm_importance_sampling_mode``): ``token_truncate`` (each token's
            policy term times ``clip(pi_old / pi_b, C_min, C_max)``; Yao et al. 2025), ``token_mask`` (tokens whose
            ratio is outside the bounds leave the policy term; ICEPOP with both bounds), ``sequence_truncate`` /
            ``sequence_mask`` (the same with one ratio per response, the product of its tokens' ratios), ``none``, or
            ``auto``: ``sequence_mask`` (TRL 1.16's default) when the policy trains on a GPU, where vLLM's kernels
            and bf16 make the two log-probs differ, ``none`` on a CPU, where both sides run fp32 and the gap is
            float noise. Here, not in ``generation.vllm``: it corrects any sampler / trainer gap, whichever backend
            sampled. The clip of ``epsilon`` stays around ``pi_old``: AReaL's decoupled PPO (docs/online_rl.md).
        importance_sampling_clip_min: ``C_min`` (``null``: no lower bound; TRL's default). At most 1.
        importance_sampling_clip_max: ``C_max`` (TRL's default 3.0; ``null``: no upper bound). At least 1.
        use_decoupled_loss: with sampler log-probs, clip the ratio around the trainer's ``pi_old`` and weight it by
            ``importance_sampling_mode`` (AReaL's decoupled PPO, Fu et al. 2025; AReaL's ``use_decoupled_loss``; what
            TRL's ``GRPOTrainer`` does with vLLM). ``false``: the coupled objective, the ratio ``pi_theta / pi_b``
            taken against the sampler's log-probs and clipped by ``epsilon``, no separate weight (TRL 1.16's
            ``AsyncGRPOTrainer``); ``importance_sampling_mode`` must then be ``auto`` or ``none``.
    """

    loss_type: PolicyLossType = "clip"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = False
    importance_sampling_mode: ImportanceSamplingMode = "auto"
    importance_sampling_clip_min: float | None = None
    importance_sampling_clip_max: float | None = 3.0
    use_decoupled_loss: bool = True

    def off_policy_mode(self, device: str, stale: bool = False) -> str:
        """``importance_sampling_mode`` for a policy on a ``device`` type (``cpu`` / ``cuda``), ``auto`` resolved:
        ``sequence_mask`` on a GPU or when the samples may come from older weights (``stale``: asynchronous
        training), else ``none``."""
        if self.importance_sampling_mode != "auto":
            return self.importance_sampling_mode
        return "sequence_mask" if device == "cuda" or stale else "none"
