"""LoRA adapters through ``peft`` (Hu et al. 2021)."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from aitraining_pl.validation import Ranges, names_gguf, replaced, rules


class _KernelsNotice(logging.Filter):
    """Drops the two lines about bitsandbytes' CPU 4-bit kernel on the hub (``kernels-community``): ``import peft``
    imports bitsandbytes, whose CPU backend tries to fetch it at import on CPUs with AVX512-BF16 (``kernels`` then
    notes it skips the publisher check offline, bitsandbytes that it could not load it), so every LoRA run printed
    them, quantized or not; a 4-bit base then runs on bitsandbytes' own kernel."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage() or "bitsandbytes" not in record.getMessage()


for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    _logger = logging.getLogger(_name)
    if not any(isinstance(f, _KernelsNotice) for f in _logger.filters):
        _logger.addFilter(_KernelsNotice())


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy; the reference policy is then the same model with adapters disabled."""

    #: allowed values of the fields (``validation.check_arguments``), checked with the module's ``lora`` group
    argument_ranges: ClassVar[Ranges] = rules("r", "alpha", "dropout")

    r: int = 8
    """Rank of the adapter matrices."""
    alpha: int = 16
    """Scaling numerator: updates are scaled by alpha / r."""
    dropout: float = 0.05
    """Dropout on the adapter input."""
    target_modules: str | list[str] = "all-linear"
    """Module names to adapt, or ``all-linear`` for every linear layer except the output head."""
    modules_to_save: list[str] | None = field(default=None)
    """Extra modules trained in full and saved with the adapters."""
    checkpoint_base: bool = False
    """Whether checkpoints also hold the frozen base model. Off, a checkpoint holds only what trains (the
    adapters, ``modules_to_save``), and a resume rebuilds the base from ``model_name`` / ``model_config``, which
    must then still give the same weights."""


#: ``peft.LoraConfig`` field -> ``LoRAConfig`` field (the fields this project's adapters carry).
PEFT_LORA_FIELDS = {
    "r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "target_modules",
    "modules_to_save": "modules_to_save",
}


def as_lora_config(lora: Any, owner: str = "lora") -> LoRAConfig | None:
    """``LoRAConfig`` from this project's dataclass, a dict of its fields (as stored in hparams, checkpoints and
    ``reward_config.json``) or ``None``: the one spelling of LoRA settings. Deprecated spellings, accepted with a
    ``RenamedArgumentWarning`` until the next release: a ``peft.LoraConfig`` and a dict with peft's field names
    (``lora_alpha``, ``lora_dropout``, ``task_type``). ``owner`` names the argument in the warning."""
    if lora is None or isinstance(lora, LoRAConfig):
        return lora
    if type(lora).__name__ == "LoraConfig" and dataclasses.is_dataclass(lora):
        replaced(owner, "a peft.LoraConfig", "LoRAConfig (r, alpha, dropout, target_modules, modules_to_save)")
        return _from_peft(lora)
    values = dict(lora)
    theirs = [k for k in values if PEFT_LORA_FIELDS.get(k, k) != k or k in ("task_type", "peft_type")]
    if theirs:
        replaced(owner, f"peft's field names ({', '.join(theirs)})", "LoRAConfig's (alpha, dropout)")
    return LoRAConfig(
        **{PEFT_LORA_FIELDS.get(k, k): v for k, v in values.items() if k not in ("task_type", "peft_type")}
    )


def _from_peft(lora: Any) -> LoRAConfig:
    """``LoRAConfig`` from a ``peft.LoraConfig``; a warning names any other field set away from peft's default
    (it is not applied)."""
    from peft import LoraConfig

    values = {ours: getattr(lora, theirs) for theirs, ours in PEFT_LORA_FIELDS.items()}
    targets = values["target_modules"]
    values["target_modules"] = (
        "all-linear" if targets is None else targets if isinstance(targets, str) else sorted(targets)
    )
    values["modules_to_save"] = list(values["modules_to_save"]) if values["modules_to_save"] else None
    default = LoraConfig()
    ignored = [
        f.name
        for f in dataclasses.fields(lora)
        if f.name not in PEFT_LORA_FIELDS
        and f.name
        not in ("task_type", "peft_type", "base_model_name_or_path", "revision", "inference_mode", "target_parameters")
        and getattr(lora, f.name) != getattr(default, f.name)
    ]
    if ignored:
        warnings.warn(
            f"peft.LoraConfig fields not applied (LoRAConfig carries {', '.join(PEFT_LORA_FIELDS)}): "
            f"{', '.join(ignored)}",
            UserWarning,
            stacklevel=4,
        )
    return LoRAConfig(**values)


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
    """Whether ``model`` is a ``peft`` model (adapters that can be disabled). Does not import ``peft``: no peft model
    exists before it is imported, and importing it costs about 60 MB of memory (it loads ``torch._dynamo`` and
    ``bitsandbytes``), which a run without LoRA need not pay."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, getattr(peft, "PeftModel", ()))


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``peft`` wrapper (its LoRA layers included), or ``model`` itself: the one
    peft unwrap of the package (its config, its decoder and head, its ``generate`` settings live there)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _plain_key(key: str, adapter: str) -> str | None:
    """The name ``key`` of a peft base model has in the plain model; None for adapter weights and for the original
    of a ``modules_to_save`` module (its trained copy takes its place)."""
    if "lora_" in key or ".original_module." in key:
        return None
    return key.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")


def plain_weights(peft_model: nn.Module, merged: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``peft_model``'s base model under their plain names, one at a time, as
    ``merge_and_unload()`` would leave them (``merged=True``) or with the LoRA layers not merged (``merged=False``),
    without copying or changing the model: a LoRA layer's ``base_layer`` weight (plus ``get_delta_weight`` of the
    active adapter when ``merged``, computed when that weight is reached, so at most one merged matrix exists at a
    time), and in both cases the trained copy of a ``modules_to_save`` module in place of its original (what the
    policy computes with), no adapter weights. ``merged=False`` is what peft's ``unload()`` left before peft 0.22;
    from 0.22 on ``unload()`` puts a ``modules_to_save`` module's untrained original back instead. Works on a
    model sharded with FSDP2 inside ``models.sharding.full_weights`` (which cannot be deep-copied), and feeds a
    generation engine's ``load_weights`` (``aitraining_pl.generation.vllm``)."""
    base = peft_model.get_base_model()
    adapter = getattr(peft_model, "active_adapter", "default")
    lora_layers = {}
    if merged:
        for name, module in base.named_modules():
            if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and adapter in module.lora_A:
                lora_layers[f"{name}.weight"] = module
    for key, value in base.state_dict().items():
        if (key := _plain_key(key, adapter)) is not None:
            value = value.detach()
            if key in lora_layers:
                value = value + lora_layers[key].get_delta_weight(adapter).detach().to(value.dtype)
            yield key, value


def plain_state_dict(peft_model: nn.Module, merged: bool) -> dict:
    """``plain_weights(peft_model, merged)`` as a state dict (an export; the merged matrices all at once)."""
    return dict(plain_weights(peft_model, merged))


def save_plain(peft_model: nn.Module, folder: str | Path, merged: bool) -> None:
    """Write ``plain_state_dict(peft_model, merged)`` as a Hugging Face folder of the base model's class. Tied
    weights (input and output embeddings) that the merge made differ are written untied, with
    ``tie_word_embeddings: false`` in the config, as peft's ``merge_and_unload`` does."""
    base = peft_model.get_base_model()
    adapter = getattr(peft_model, "active_adapter", "default")
    state = plain_state_dict(peft_model, merged)
    names: dict[int, list[str]] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        if (key := _plain_key(name, adapter)) in state:
            names.setdefault(id(param), []).append(key)
    diverged = any(not torch.equal(state[keys[0]], state[k]) for keys in names.values() for k in keys[1:])
    untie = merged and diverged and getattr(base.config, "tie_word_embeddings", False)
    if untie:
        base.config.tie_word_embeddings = False
    try:
        base.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    finally:
        if untie:
            base.config.tie_word_embeddings = True


#: subfolder of a LoRA export holding the base weights when the base has no folder or hub id of its own.
ADAPTER_BASE_DIR = "base"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def save_adapter_base(
    peft_model: nn.Module,
    folder: str | Path,
    model_name: str | None,
    tokenizer=None,
    full_base: nn.Module | None = None,
) -> str:
    """Make the LoRA export in ``folder`` name a loadable base in ``adapter_config.json``'s
    ``base_model_name_or_path``, so ``peft.AutoPeftModelForCausalLM.from_pretrained(folder)`` works offline.

    The base is ``model_name`` (a hub id as given; a local folder as its absolute path), or, for a model built
    from an inline config (no folder, no hub id) or read from a GGUF file (which peft cannot load as a base), its
    base weights (adapters removed, not merged; a GGUF's dequantised) and
    ``tokenizer`` written to ``<folder>/base/`` and named by that folder's absolute path: peft resolves a
    relative ``base_model_name_or_path`` against the current directory, not the adapter folder. ``full_base``
    (a QLoRA policy's full-precision base) is written there instead of the peft model's own base weights. After
    moving the export, ``link_adapter_base(new_folder)`` points it at its ``base/`` again. Returns the name
    written."""
    folder = Path(folder)
    if model_name is not None and not names_gguf(model_name):
        base = str(Path(model_name).resolve()) if Path(model_name).is_dir() else model_name
    else:
        if full_base is not None:
            full_base.save_pretrained(str(folder / ADAPTER_BASE_DIR), safe_serialization=True)
        else:
            save_plain(peft_model, folder / ADAPTER_BASE_DIR, merged=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder / ADAPTER_BASE_DIR))
        base = str((folder / ADAPTER_BASE_DIR).resolve())
    _set_adapter_base(folder, base)
    return base


def link_adapter_base(folder: str | Path, final_folder: str | Path | None = None) -> str | None:
    """Point the ``adapter_config.json`` of ``folder`` at ``<final_folder>/base`` (default ``final_folder``:
    ``folder``) when ``folder`` has a ``base/`` subfolder (written by ``save_adapter_base``); returns the name
    written, or ``None`` when there is no such base. Call it after moving an export, or (as the export callback
    does) before renaming a finished export into ``final_folder``."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG_FILE).is_file() or not (folder / ADAPTER_BASE_DIR).is_dir():
        return None
    final = Path(final_folder) if final_folder is not None else folder
    return _set_adapter_base(folder, str((final / ADAPTER_BASE_DIR).resolve()))


def _set_adapter_base(folder: Path, base: str) -> str:
    config_file = folder / ADAPTER_CONFIG_FILE
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return base
