"""QLoRA (Dettmers et al. 2023): base weights loaded in 4 bits through bitsandbytes, LoRA adapters trained on
top in full precision (the optional extra ``qlora``: ``pip install aitraining-pl[qlora]``).

The quantized model is frozen; only the adapters train, so a module asks for ``lora`` whenever it asks for
``quantization``. The reference of a LoRA policy is the same 4-bit base with the adapters off. An export with
``merge_lora`` adds the adapters to the *full-precision* base reloaded from its source (not to the 4-bit
weights, whose rounding would otherwise be baked in), so it loads in plain transformers.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from aitraining_pl.errors import ConfigError
from aitraining_pl.models.lora import base_model


@dataclass
class QuantizationConfig:
    """4-bit base weights (bitsandbytes ``Linear4bit``); the output head and embeddings stay as loaded."""

    load_in_4bit: bool = True
    """Load the linear layers' weights in 4 bits (``false``: no quantization)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type: ``nf4`` (NormalFloat, QLoRA's) or ``fp4``."""
    compute_dtype: str = "float32"
    """Dtype the 4-bit weights are dequantized to for each matmul (``bfloat16`` on GPUs)."""
    double_quant: bool = False
    """Quantize the quantization constants too (QLoRA's double quantization; about 0.4 bits less per weight)."""


def as_quantization_config(value: Any) -> QuantizationConfig | None:
    """``QuantizationConfig`` from itself, a dict (as stored in hparams) or ``None``; ``None`` when off."""
    if value is None:
        return None
    config = value if isinstance(value, QuantizationConfig) else QuantizationConfig(**dict(value))
    return config if config.load_in_4bit else None


def quantization_hparam(value: Any) -> dict | None:
    """The primitive form kept in hparams and checkpoints."""
    config = as_quantization_config(value)
    return dataclasses.asdict(config) if config is not None else None


def bitsandbytes_config(config: QuantizationConfig):
    """transformers' ``BitsAndBytesConfig`` for ``config``."""
    from transformers import BitsAndBytesConfig

    from aitraining_pl.models.loading import resolve_dtype

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ConfigError("quantization", "4-bit loading needs bitsandbytes: pip install aitraining-pl[qlora]") from err
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=config.quant_type,
        bnb_4bit_compute_dtype=resolve_dtype(config.compute_dtype) or torch.float32,
        bnb_4bit_use_double_quant=config.double_quant,
    )


def _device_map() -> dict[str, Any]:
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", 0))}
    return {"": "cpu"}


def load_quantized(
    load_full: Callable[[], nn.Module],
    model_name: str | None,
    config: QuantizationConfig,
    auto_class: str = "AutoModelForCausalLM",
    **kwargs,
):
    """A model (``auto_class``: a causal LM, or ``AutoModel`` for a reward model's trunk) with 4-bit linear
    layers, ready for LoRA (``peft.prepare_model_for_kbit_training``: the other weights in float32, input
    gradients on). From ``model_name`` it loads quantized directly; a model built from an inline config
    (``load_full()``) goes through a temporary folder (small models only)."""
    import transformers
    from peft import prepare_model_for_kbit_training

    from aitraining_pl.models.loading import from_pretrained

    auto = getattr(transformers, auto_class)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    quant = {"quantization_config": bitsandbytes_config(config), "device_map": _device_map()}
    if model_name is not None:
        model = from_pretrained(auto.from_pretrained, model_name, "model", **kwargs, **quant)
    else:
        with tempfile.TemporaryDirectory() as folder:
            load_full().save_pretrained(folder, safe_serialization=True)
            model = auto.from_pretrained(folder, **quant)
    keep_one_weight_format(model)
    return prepare_model_for_kbit_training(model.train(), use_gradient_checkpointing=False)  # eval after loading


def keep_one_weight_format(model: nn.Module) -> None:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights in every ``Linear4bit`` of ``model``.

    On a CPU with AVX512-BF16, a ``Linear4bit`` that runs in eval mode without gradients (validation, the
    reference pass: adapters off, ``no_grad``) repacks its weight in place for an inference kernel that computes in
    bfloat16 (bitsandbytes 0.50). For training that is wrong twice: the reference log-probs would then come from
    bfloat16 matmuls while the policy's come from ``compute_dtype`` (the KL and DPO margins would hold the rounding
    difference, and only on some CPUs), and the repacking fails outright on layers whose input size is not a
    multiple of the 64-weight quantization block (``shape '[32, 0]' is invalid``). Every pass here uses the one
    dequantize-then-matmul path that training uses, on every CPU."""
    for layer in model.modules():
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` (or the base model of a peft wrapper) holds bitsandbytes 4-bit layers."""
    base = base_model(model)
    return bool(getattr(base, "is_loaded_in_4bit", False))


def merged_full_precision_state(peft_model: nn.Module, full_base: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``full_base`` (the full-precision model the 4-bit one was loaded from) with each LoRA
    layer's update added to its weight and the trained copies of other trainable modules (``modules_to_save``)
    in place; the 4-bit weights themselves are not used."""
    from aitraining_pl.models.lora import plain_state_dict

    base = peft_model.get_base_model()
    adapter = getattr(peft_model, "active_adapter", "default")
    deltas = {
        f"{name}.weight": module.get_delta_weight(adapter)
        for name, module in base.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and adapter in module.lora_A
    }
    live = plain_state_dict(peft_model, merged=False)
    state = {}
    for key, value in full_base.state_dict().items():
        if key in deltas:
            value = value + deltas[key].to(value.device, value.dtype)
        elif key in live and live[key].shape == value.shape:  # not quantized: the live (possibly trained) tensor
            value = live[key].to(value.device, value.dtype)
        state[key] = value.detach()
    return state


def check_quantization(quantization: Mapping | QuantizationConfig | None, lora: Any) -> None:
    """4-bit weights cannot be trained: ``quantization`` needs ``lora``."""
    if as_quantization_config(quantization) is not None and lora is None:
        raise ConfigError("quantization", "4-bit base weights are frozen: set lora too (QLoRA)")
