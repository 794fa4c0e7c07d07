"""The built-in losses of Thinking Machines' Tinker API, per token, as its documentation defines them
(https://tinker-docs.thinkingmachines.ai/tinker/losses and its pages ``ppo``, ``cispo``, ``dro``).

Every function takes the learner's log-probabilities of the target tokens ``target_logprobs`` (N,) with gradients,
the datum's ``loss_fn_inputs`` as float tensors (N,) (``weights``; ``logprobs``, the sampler's log-probabilities
``q``; ``advantages``) and the request's ``loss_fn_config``, and returns the elementwise loss (N,). Tinker's loss
of a batch is the SUM of these over every token of every datum (its ``loss:sum`` diagnostic); nothing is averaged.

- ``cross_entropy``: ``-weights * log p`` (tokens with weight 0 do not count).
- ``importance_sampling``: ``-(p / q) * A``, the REINFORCE estimator with an importance weight for off-policy
  samples (its gradient is ``-(p / q) * A * grad log p``).
- ``ppo``: ``-min(r * A, clip(r, low, high) * A)`` with ``r = p / q`` (Schulman et al. 2017), ``low`` / ``high`` from
  ``clip_low_threshold`` / ``clip_high_threshold`` (0.8 and 1.2 by default: epsilon 0.2 both ways).
- ``cispo``: ``-sg(clip(r, low, high)) * log p * A`` (MiniMax-M1, Chen et al. 2025): the clipped ratio weighs
  the log-likelihood gradient and is not differentiated.
- ``dro``: ``-(log p * A - beta / 2 * (log p - log q)^2)`` (Richemond et al. 2024), ``beta`` from the config
  (default 0.05).
- ``gspo``: GSPO-token (Zheng et al. 2025, §4.3; https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo):
  ``-min(s_t * A, clip(s_t, low, high) * A)`` with ``s_t = sg(s) * p / sg(p)``, where ``s = exp(mean over M of
  (log p - log q))`` and ``M`` the tokens ``sequence_ratio_mask`` marks: every token carries the sequence ratio's
  value and its own log-probability's gradient. The page we read gives the formula, not the config's defaults;
  this server takes ``ppo``'s keys and defaults. A datum whose mask marks no token takes ``s = 1``.

Named by the client's ``LossFnType`` and not here: ``stable_reinforce`` (its objective uses information the hosted
sampler records, ``record_stability_info``, and Tinker's page does not publish its formula) and ``custom`` (a loss
uploaded to the hosted server); ``UNSERVED_LOSSES`` says so in the server's refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from aitraining_pl.losses.policy_options import clipped_surrogate, sequence_log_ratio_mean

TinkerLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]

#: name -> elementwise loss ``fn(target_logprobs, inputs, config) -> (N,)``
TINKER_LOSSES: dict[str, TinkerLoss] = {}
#: name -> the ``loss_fn_inputs`` it needs besides ``target_tokens``
TINKER_LOSS_INPUTS: dict[str, tuple[str, ...]] = {}
#: name -> the ``loss_fn_config`` keys it reads, with their defaults
TINKER_LOSS_CONFIG: dict[str, dict[str, float]] = {}
#: losses the ``tinker`` client names (``types.LossFnType``) that this module does not define, with the reason
UNSERVED_LOSSES = {
    "stable_reinforce": "its objective needs the stability records the hosted sampler keeps (record_stability_info, "
    "provenance spans) and Tinker does not publish its formula; use importance_sampling, cispo or gspo",
    "custom": "server-side uploaded losses are not run here; use forward_backward_custom (a client-side loss)",
}


def _register(name: str, inputs: tuple[str, ...], config: dict[str, float] | None = None):
    def add(fn: TinkerLoss) -> TinkerLoss:
        TINKER_LOSSES[name], TINKER_LOSS_INPUTS[name], TINKER_LOSS_CONFIG[name] = fn, inputs, dict(config or {})
        return fn

    return add


def _ratio(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(target_logprobs - inputs["logprobs"])


@_register("cross_entropy", ("weights",))
def cross_entropy(target_logprobs, inputs, config):
    """``-weights * log p`` per token."""
    return -inputs["weights"] * target_logprobs


@_register("importance_sampling", ("logprobs", "advantages"))
def importance_sampling(target_logprobs, inputs, config):
    """``-(p / q) * A`` per token."""
    return -_ratio(target_logprobs, inputs) * inputs["advantages"]


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@_register("ppo", ("logprobs", "advantages"), _CLIP)
def ppo(target_logprobs, inputs, config):
    """``-min(r * A, clip(r, low, high) * A)`` per token: the core's ``clipped_surrogate`` with epsilon
    ``1 - low`` and epsilon_high ``high - 1``."""
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio = _ratio(target_logprobs, inputs)
    return clipped_surrogate(ratio, target_logprobs, inputs["advantages"], 1 - low, high - 1)


@_register("cispo", ("logprobs", "advantages"), _CLIP)
def cispo(target_logprobs, inputs, config):
    """``-sg(clip(r, low, high)) * log p * A`` per token (Tinker clips both sides; the core's
    ``cispo_surrogate`` bounds the ratio from above only, as MiniMax-M1 does)."""
    clipped = _ratio(target_logprobs, inputs).clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -clipped.detach() * target_logprobs * inputs["advantages"]


@_register("dro", ("logprobs", "advantages"), {"beta": 0.05})
def dro(target_logprobs, inputs, config):
    """``-(log p * A - beta / 2 * (log p - log q)^2)`` per token."""
    penalty = (target_logprobs - inputs["logprobs"]) ** 2
    return -(target_logprobs * inputs["advantages"] - 0.5 * config["beta"] * penalty)


@_register("gspo", ("logprobs", "advantages", "sequence_ratio_mask"), _CLIP)
def gspo(target_logprobs, inputs, config):
    """GSPO-token per token: ``-min(s_t * A, clip(s_t, low, high) * A)``, ``s_t = sg(s) * p / sg(p)``; the
    sequence log-ratio is the core's ``sequence_log_ratio_mean`` over ``sequence_ratio_mask``, the clip the
    core's ``clipped_surrogate``."""
    detached = target_logprobs.detach()
    log_s = sequence_log_ratio_mean(detached[None], inputs["logprobs"][None], inputs["sequence_ratio_mask"][None] != 0)
    ratio = torch.exp(log_s[0] + target_logprobs - detached)
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    return clipped_surrogate(ratio, target_logprobs, inputs["advantages"], 1 - low, high - 1)


def loss_config(name: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config: its defaults updated with ``given``; a ``ValueError`` naming an unknown key."""
    defaults = TINKER_LOSS_CONFIG[name]
    unknown = sorted(set(given or {}) - set(defaults))
    if unknown:
        known = ", ".join(defaults) or "none"
        raise ValueError(f"loss_fn {name!r} takes no loss_fn_config key {', '.join(unknown)} (it takes: {known})")
    return {**defaults, **{k: float(v) for k, v in (given or {}).items()}}
