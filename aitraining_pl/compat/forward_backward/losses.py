"""The pipeline's built-in losses: a registry of small functions over per-token log-probs of label tokens.

Every loss gets a ``LossInputs`` (log-probs of the label tokens, their mask, the logits, and the model's
values if it has a value head) plus the keyword arguments given to ``forward_backward``, and returns
``(scalar loss, stats)``. Per-token arguments (``old_logprobs``, ``advantages``, ``values``, ``returns``)
may be (B, T - 1), aligned with the shifted labels, or (B, T), aligned with ``input_ids`` (the first
column is then ignored: token 0 is never predicted); ``advantages`` and ``returns`` may also be (B,), one
per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aitraining_pl.losses import clipped_policy_loss, masked_mean, ppo_value_loss
from aitraining_pl.losses.tinker import TINKER_LOSSES


@dataclass
class LossInputs:
    logprobs: torch.Tensor  #: (B, T - 1) log p(label_{t+1} | tokens <= t)
    mask: torch.Tensor  #: (B, T - 1) float, 1 where the label token counts
    logits: torch.Tensor  #: (B, T, V)
    values: torch.Tensor | None = None  #: (B, T - 1) values of the states that predict each label


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

#: name -> loss function ``fn(inputs: LossInputs, **kwargs) -> (loss, stats)``.
PIPELINE_LOSSES: dict[str, LossFn] = {}
#: name -> keyword arguments the loss cannot do without (checked before the work is queued).
REQUIRED_KWARGS: dict[str, tuple[str, ...]] = {}


def register_loss(name: str, required: tuple[str, ...] = ()) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to ``PIPELINE_LOSSES`` under ``name``."""

    def add(fn: LossFn) -> LossFn:
        PIPELINE_LOSSES[name] = fn
        REQUIRED_KWARGS[name] = tuple(required)
        return fn

    return add


def check_loss_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Raise a clear error for an unknown loss or a missing required keyword argument."""
    if name not in PIPELINE_LOSSES:
        raise ValueError(
            f"unknown loss_fn {name!r}; built in: {', '.join(PIPELINE_LOSSES)} (or use forward_backward_custom)"
        )
    missing = [k for k in REQUIRED_KWARGS[name] if kwargs.get(k) is None]
    if missing:
        raise ValueError(f"loss_fn {name!r} needs {', '.join(missing)}")


def align(value: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` as a float tensor shaped like ``like`` (B, T - 1): from (B, T - 1), (B, T) or (B,)."""
    tensor = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    batch, steps = like.shape
    if tensor.dim() == 1 and tensor.shape[0] == batch:
        return tensor[:, None].expand(batch, steps)
    if tensor.dim() == 2 and tensor.shape[0] == batch and tensor.shape[1] in (steps, steps + 1):
        return tensor[:, -steps:]
    raise ValueError(
        f"{name} has shape {tuple(tensor.shape)}; expected ({batch},), ({batch}, {steps}) or ({batch}, {steps + 1})"
    )


@register_loss("cross_entropy")
def cross_entropy(inputs: LossInputs, **_: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Language-modelling loss: mean negative log-likelihood of the label tokens (Tinker's ``cross_entropy`` per
    token, ``losses.tinker``, averaged over the label tokens)."""
    loss = masked_mean(TINKER_LOSSES["cross_entropy"](inputs.logprobs, {"weights": inputs.mask}, {}), inputs.mask)
    return loss, {"nll": loss.item()}


@register_loss("importance_sampling", required=("old_logprobs", "advantages"))
def importance_sampling(
    inputs: LossInputs, old_logprobs: Any, advantages: Any, **_: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy policy gradient with per-token importance weights, the unclipped surrogate of TRPO
    (Schulman et al. 2015): ``L = -mean(exp(logp - old_logp) * A)`` over label tokens (Tinker's
    ``importance_sampling`` per token, ``losses.tinker``, averaged). Its gradient is the
    policy gradient for samples drawn from the policy that gave ``old_logprobs``."""
    old = align(old_logprobs, inputs.logprobs, "old_logprobs")
    adv = align(advantages, inputs.logprobs, "advantages")
    per_token = TINKER_LOSSES["importance_sampling"](inputs.logprobs, {"logprobs": old, "advantages": adv}, {})
    ratio = torch.exp(inputs.logprobs.detach() - old)
    return masked_mean(per_token, inputs.mask), {"ratio": masked_mean(ratio, inputs.mask).item()}


@register_loss("ppo", required=("old_log_probs", "advantages"))
def ppo(
    inputs: LossInputs,
    old_log_probs: Any,
    advantages: Any,
    values: Any = None,
    returns: Any = None,
    clip_ratio: float = 0.2,
    value_clip: float = 0.2,
    value_coef: float = 0.5,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate (Schulman et al. 2017), plus ``value_coef`` times the clipped value loss when
    ``returns`` are given. The new values come from the model's value head (e.g. ``PPOModel``); ``values``
    are the rollout's old values, used for value clipping (no clipping without them)."""
    old = align(old_log_probs, inputs.logprobs, "old_log_probs")
    adv = align(advantages, inputs.logprobs, "advantages")
    loss, stats = clipped_policy_loss(inputs.logprobs, old, adv, inputs.mask, clip_ratio, aggregation="token")
    ratio = masked_mean(torch.exp(inputs.logprobs.detach() - old), inputs.mask)
    out = {"policy_loss": loss.item(), **{k: v.item() for k, v in stats.items()}, "ratio": ratio.item()}
    if returns is not None:
        if inputs.values is None:
            raise ValueError(
                "ppo with returns needs a model with a value head (e.g. PPOModel); this model gives no values"
            )
        target = align(returns, inputs.logprobs, "returns")
        old_values = align(values, inputs.logprobs, "values") if values is not None else inputs.values.detach()
        value_loss = ppo_value_loss(inputs.values, old_values, target, inputs.mask, value_clip)
        loss = loss + value_coef * value_loss
        out["value_loss"] = value_loss.item()
    elif values is not None:
        raise ValueError("ppo got values but no returns; the value loss needs returns")
    return loss, out
