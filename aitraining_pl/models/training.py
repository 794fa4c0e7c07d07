"""Training-time switches applied to whole networks: eval mode for a block, no dropout, gradient checkpointing,
float32 master weights."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from aitraining_pl.models.lora import base_model
from aitraining_pl.models.packing import checkpoint_contexts

#: attribute names of dropout rates held as plain floats (HF attention's ``attention_dropout``, OPT's ``dropout``,
#: Phi's ``resid_pdrop``, OPT's ``layerdrop``) by modules, or read from the config in ``forward`` (Falcon)
_DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_rate")


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Run the block with ``module`` in eval mode; every submodule's own mode is restored afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training


def _zero_rates(obj: object) -> None:
    for name, value in list(vars(obj).items()):
        if _DROPOUT_NAME.search(name) and isinstance(value, float) and value:
            setattr(obj, name, 0.0)


def disable_dropout(*models: nn.Module) -> None:
    """Set every dropout rate in ``models`` to 0 (as TRL's ``disable_dropout``): ``nn.Dropout`` modules (LoRA's
    ``lora_dropout`` included), float rates held by modules, and the float rates of transformers configs that
    some models read in ``forward`` (the exported config then records 0: the rate the model was trained with).
    Training-mode forwards become deterministic, so PPO's ratio is 1 and DPO's rewards 0 before any update."""
    from transformers import PretrainedConfig

    for model in models:
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0
            _zero_rates(module)
            config = getattr(module, "config", None)
            if isinstance(config, PretrainedConfig):
                _zero_rates(config)
                for sub in vars(config).values():
                    if isinstance(sub, PretrainedConfig):
                        _zero_rates(sub)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each layer's activations in backward instead of storing them (Chen et al. 2016), through
    transformers' own per-layer checkpointing (non-reentrant). The recomputation sees the attention the forward
    used, packed included (``packing.checkpoint_contexts``)."""
    lm = base_model(model)
    if not getattr(lm, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(lm).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False, "context_fn": checkpoint_contexts}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def keep_float32(module: nn.Module) -> int:
    """Cast the trainable floating-point parameters of ``module`` to float32 in place (the same ``Parameter``
    objects: tied weights stay tied); frozen ones (a LoRA base, a 4-bit base) keep their dtype. Returns how many
    were cast."""
    cast = 0
    for p in module.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)
            cast += 1
    return cast
