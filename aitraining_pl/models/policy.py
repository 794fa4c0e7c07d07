"""The trainable policy and its reference, built from one source description."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from aitraining_pl.models.loading import load_causal_lm
from aitraining_pl.models.lora import LoRAConfig, apply_lora
from aitraining_pl.models.reference import ReferencePolicy


def load_policy(
    model_name: str | None = None,
    model_config: Mapping[str, Any] | None = None,
    lora: LoRAConfig | None = None,
    *,
    with_reference: bool = True,
    **load_kwargs: Any,
) -> tuple[nn.Module, ReferencePolicy | None]:
    """Load the policy (LoRA-wrapped when ``lora`` is given) and, if asked, its reference policy.

    Without LoRA the reference is a frozen model loaded again from ``model_name`` / ``model_config``
    (the source, never the live policy). ``load_kwargs`` go to ``load_causal_lm`` (``dtype``,
    ``attn_implementation``, ``trust_remote_code``, ``seed``).
    """
    source = functools.partial(load_causal_lm, model_name, model_config, **load_kwargs)
    policy = source()
    if lora is not None:
        policy = apply_lora(policy, lora)
    reference = ReferencePolicy(policy, build_reference=source) if with_reference else None
    return policy, reference
