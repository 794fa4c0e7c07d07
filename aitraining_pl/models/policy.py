"""The trainable policy and its reference, built from one source description."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from aitraining_pl.models.loading import load_causal_lm
from aitraining_pl.models.lora import LoRAConfig, apply_lora
from aitraining_pl.models.quantization import (
    QuantizationConfig,
    as_quantization_config,
    check_quantization,
    load_quantized,
)
from aitraining_pl.models.reference import ReferencePolicy


def load_policy(
    model_name: str | None = None,
    model_config: Mapping[str, Any] | None = None,
    lora: LoRAConfig | None = None,
    *,
    with_reference: bool = True,
    quantization: QuantizationConfig | Mapping[str, Any] | None = None,
    **load_kwargs: Any,
) -> tuple[nn.Module, ReferencePolicy | None]:
    """Load the policy (LoRA-wrapped when ``lora`` is given) and, if asked, its reference policy.

    Without LoRA the reference is a frozen model loaded again from ``model_name`` / ``model_config``
    (the source, never the live policy). ``load_kwargs`` go to ``load_causal_lm`` (``dtype``,
    ``attn_implementation``, ``trust_remote_code``, ``seed``). ``quantization`` loads the base in 4 bits
    (QLoRA, ``models.quantization``; it needs ``lora``): the reference is then the 4-bit base, adapters off.
    """
    source = functools.partial(load_causal_lm, model_name, model_config, **load_kwargs)
    check_quantization(quantization, lora)
    quantized = as_quantization_config(quantization)
    if quantized is not None:
        keep = ("attn_implementation", "trust_remote_code")
        policy = load_quantized(source, model_name, quantized, **{k: load_kwargs.get(k) for k in keep})
    else:
        policy = source()
    if lora is not None:
        policy = apply_lora(policy, lora)
    reference = ReferencePolicy(policy, build_reference=source) if with_reference else None
    return policy, reference
