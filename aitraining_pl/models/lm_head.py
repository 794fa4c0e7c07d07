"""The language-model head of a transformers causal LM as tensors: its weight (LoRA merged), bias and the logit
post-processing its ``forward`` applies, so tokens are scored by ``losses.fused_head_logps`` without building
(tokens x vocabulary) logits; and the head kernels every scoring path ends in (text, packed or padded:
``models.scoring``; with images: ``models.vision_scoring``): ``head_scores`` from hidden states, ``logits_scores``
from logits, ``head_logits`` where the head runs whole, and what a scoring path returns (``TokenScores``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from aitraining_pl.losses import HeadLogps, entropy_from_logits, fused_head_logps, selective_log_softmax

#: model_type -> (config attribute, multiply or divide): the scale transformers' ``forward`` applies to the head
LOGIT_SCALES = {
    **{
        name: ("logits_scaling", "divide")
        for name in (
            "granite",
            "granite_swa",
            "granitemoe",
            "granitemoe_swa",
            "granitemoeshared",
            "granitemoehybrid",
            "minicpm3",
        )
    },
    **{name: ("logit_scale", "multiply") for name in ("cohere", "cohere2", "cohere2_moe")},
    "falcon_h1": ("lm_head_multiplier", "multiply"),
    "hyperclovax": ("logits_scaling", "multiply"),
}
#: config attributes that scale logits in some architecture; a model type not in ``LOGIT_SCALES`` that sets one
#: is scored through its own forward
SCALE_ATTRIBUTES = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier")


def logit_postprocessing(config: Any) -> tuple[float, float | None] | None:
    """``(scale, softcap)`` that the model's ``forward`` applies to the head's output (Granite divides by
    ``logits_scaling``, Cohere multiplies by ``logit_scale``, FalconH1 by ``lm_head_multiplier``, Gemma 2/3 soft-cap
    with ``final_logit_softcapping``), or None for a model that scales its logits in a way not listed here."""
    model_type = getattr(config, "model_type", None)
    scale = 1.0
    if model_type in LOGIT_SCALES:
        name, op = LOGIT_SCALES[model_type]
        value = getattr(config, name, None)
        if value is not None:
            scale = float(value) if op == "multiply" else 1.0 / float(value)
    elif any(getattr(config, name, None) is not None for name in SCALE_ATTRIBUTES):
        return None
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, float(softcap) if softcap else None


def _lora_weight(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``W + sum_a s_a B_a A_a`` of a ``peft`` LoRA linear head (differentiable), or None where that merge is not
    what its forward computes (LoRA variants, adapter biases, active dropout)."""
    base = head.base_layer
    if head.merged:
        return None if head.disable_adapters else (base.weight, base.bias)
    weight = base.weight
    if head.disable_adapters:
        return weight, base.bias
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        dropout = head.lora_dropout[name]
        if (
            name in getattr(head, "lora_variant", {})
            or head.lora_B[name].bias is not None
            or (isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0)
        ):
            return None
        weight = weight + head.get_delta_weight(name)
    return weight, base.bias


def head_parameters(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight (V, H), bias (V,) or None)`` that ``head`` applies, or None when ``head`` is not a linear layer
    (or a ``peft`` LoRA linear layer whose forward is a merged linear layer)."""
    if type(head) is nn.Linear:
        return head.weight, head.bias
    if type(getattr(head, "base_layer", None)) is nn.Linear and hasattr(head, "get_delta_weight"):
        return _lora_weight(head)
    return None


def chunked_head_logps(
    head: nn.Module,
    config: Any,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> HeadLogps | None:
    """Log-probs (M,) of ``targets`` (and entropies when asked) from hidden states (M, H) through
    ``fused_head_logps``: no (M, V) logits are built, in the forward or for the backward. None where the head is
    not a (LoRA) linear layer or ``config`` scales logits in a way ``logit_postprocessing`` does not know: the
    caller then runs the head itself."""
    post, params = logit_postprocessing(config), head_parameters(head)
    if post is None or params is None:
        return None
    return fused_head_logps(
        hidden,
        params[0],
        targets,
        params[1],
        scale=post[0],
        softcap=post[1],
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )


def head_logits(head: nn.Module, config: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on ``hidden`` with the post-processing transformers models apply in ``forward``
    (``logit_postprocessing``: Granite, Cohere, FalconH1 scales, Gemma 2/3 soft-cap). A scaling
    not listed there is left out here, so the probe (``scoring_path``) sends that model to its own forward."""
    logits = head(hidden)
    post = logit_postprocessing(config)
    if post is None:
        return logits
    scale, cap = post
    if scale != 1.0:
        logits = logits * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def logits_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool) -> HeadLogps:
    """Log-probs (and entropies) of ``targets`` from (M, V) logits (the fallback where the head cannot run fused)."""
    logits = logits.float() / temperature
    return HeadLogps(selective_log_softmax(logits, targets), entropy_from_logits(logits) if with_entropy else None)


def head_scores(
    head: nn.Module,
    config: Any,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> HeadLogps:
    """(M,) log-probs of ``targets`` (and entropies) from hidden states (M, H): chunked for a linear head whose
    post-processing is known (``chunked_head_logps``: no (M, V) logits, in the forward or saved for backward), else
    the head's logits."""
    chunked = chunked_head_logps(head, config, hidden, targets, temperature=temperature, with_entropy=with_entropy)
    if chunked is not None:
        return chunked
    return logits_scores(head_logits(head, config, hidden), targets, temperature, with_entropy)


class TokenScores(NamedTuple):
    """What ``token_scores`` returns; per-token tensors are (B, L - 1), entry [b, t] for token t + 1."""

    logps: torch.Tensor  #: log-probs of the scored tokens, 0 elsewhere
    entropy: torch.Tensor | None  #: entropies of the distributions predicting them (``with_entropy``), or None
    hidden: torch.Tensor | None  #: (M, H) last hidden states predicting them, in ``index`` order (``with_hidden``)
    index: tuple[torch.Tensor, torch.Tensor]  #: (rows, columns) (M,) each: where the scored tokens' entries are
