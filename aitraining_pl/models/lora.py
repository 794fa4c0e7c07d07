"""LoRA adapters through ``peft`` (Hu et al. 2021)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from torch import nn


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy; the reference policy is then the same model with adapters disabled."""

    r: int = 8
    """Rank of the adapter matrices."""
    alpha: int = 16
    """Scaling numerator: updates are scaled by alpha / r."""
    dropout: float = 0.05
    """Dropout on the adapter input."""
    target_modules: Union[str, list[str]] = "all-linear"
    """Module names to adapt, or ``all-linear`` for every linear layer except the output head."""
    modules_to_save: Optional[list[str]] = field(default=None)
    """Extra modules trained in full and saved with the adapters."""


def apply_lora(model: nn.Module, config: LoRAConfig, task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` in a ``peft`` LoRA model (base weights frozen, adapters trainable).

    ``task_type`` is a ``peft.TaskType`` name: ``CAUSAL_LM`` for a policy, ``FEATURE_EXTRACTION`` for a bare
    trunk (``AutoModel``) such as a reward model's."""
    from peft import LoraConfig, TaskType, get_peft_model

    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=config.target_modules,
        modules_to_save=config.modules_to_save,
        task_type=TaskType[task_type],
    )
    return get_peft_model(model, peft_config)


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft`` model (adapters that can be disabled)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)
