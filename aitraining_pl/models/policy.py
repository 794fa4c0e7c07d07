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
from aitraining_pl.models.vision import freeze_vision_tower, language_model_lora, load_vision_lm, vision_source


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
    A vision-language source loads through ``models.vision`` (``freeze_vision_tower``, default True: no gradients
    for its vision encoder; LoRA's ``all-linear`` adapts the language model only).
    """
    freeze_vision = load_kwargs.pop("freeze_vision_tower", True)
    vision = vision_source(model_name, model_config, bool(load_kwargs.get("trust_remote_code")))
    load = load_vision_lm if vision else load_causal_lm  # VL models: models.vision
    source = functools.partial(load, model_name, model_config, **load_kwargs)
    check_quantization(quantization, lora)
    quantized = as_quantization_config(quantization)
    if quantized is not None:
        keep = ("attn_implementation", "trust_remote_code")
        policy = load_quantized(source, model_name, quantized, **{k: load_kwargs.get(k) for k in keep})
    else:
        policy = source()
    if vision and freeze_vision:
        freeze_vision_tower(policy)
    if lora is not None:
        policy = apply_lora(policy, language_model_lora(policy, lora) if vision else lora)
    reference = ReferencePolicy(policy, build_reference=source) if with_reference else None
    return policy, reference
