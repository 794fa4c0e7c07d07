"""LoRA policies push adapters, not merged weights: the base weights go once (unmerged), then each push carries
only the adapter (``AdapterWeights``: the ``peft`` state dict of the LoRA matrices and the adapter's config),
written as a ``peft`` adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) in shared memory.

- A ``vllm serve`` started with ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` loads
  it as a dynamic LoRA adapter (``/v1/load_lora_adapter``, in place after the first), and the rollouts name it as
  their ``model``. A named adapter (``AdapterWeights.name``: ``tinker-serve``'s sampler weights, one per sampler
  path) is kept beside the others under its name until ``HTTPReplica.unload_adapter``; a request naming it
  (``SampleRequest.adapter``) samples with it.
- The HF server applies it itself (``merged``): each target weight becomes the base weight plus ``scale * B @ A``
  (``scale``: ``lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA), checked as any push (``checks.WeightSpecs``: the
  targets must be the served model's, the matrices' shapes must fit them, every value finite).

Adapters with ``modules_to_save`` or DoRA are pushed merged instead (``supported``)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.generation.servers.checks import PushRefused, WeightSpecs

#: the prefix of a ``peft`` adapter's tensor names before the base model's own
PEFT_PREFIX = "base_model.model."


@dataclass
class AdapterWeights:
    """One LoRA adapter to push: ``tensors`` (``peft``'s names, ``...lora_A.weight`` / ``lora_B.weight``),
    ``config`` (its ``adapter_config.json``) and ``name``: None for the policy's adapter (the rollouts' weights), or a
    name a ``vllm serve`` keeps it under beside the others, which a ``SampleRequest.adapter`` then names (the HF
    server, which merges one adapter at a time, ignores it)."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    name: str | None = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __iter__(self):  # a ``Replica.push`` of weights that do not know adapters sees the tensors
        return iter(self.tensors.items())


def supported(peft_model: torch.nn.Module) -> bool:
    """Whether ``peft_model``'s active adapter can be pushed alone: LoRA without ``modules_to_save`` or DoRA."""
    config = peft_model.peft_config[getattr(peft_model, "active_adapter", "default")]
    return (str(getattr(config, "peft_type", "")).endswith("LORA") and not getattr(config, "modules_to_save", None)
            and not getattr(config, "use_dora", False))  # fmt: skip


def adapter_weights(peft_model: torch.nn.Module) -> AdapterWeights:
    """The active adapter of ``peft_model`` as ``AdapterWeights`` (CPU copies)."""
    from peft import get_peft_model_state_dict

    adapter = getattr(peft_model, "active_adapter", "default")
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    return AdapterWeights(tensors, config_json(peft_model.peft_config[adapter]))


def config_json(config: Any) -> dict[str, Any]:
    """A ``peft`` adapter config as the JSON object of its ``adapter_config.json``."""
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.loads(json.dumps(config, default=str))


def write_adapter(folder: str | os.PathLike, adapter: AdapterWeights) -> Path:
    """``adapter`` as a ``peft`` adapter folder ``folder``; the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    (folder / "adapter_config.json").write_text(json.dumps(adapter.config))
    save_file(adapter.tensors, str(folder / "adapter_model.safetensors"))
    return folder


def lora_scale(config: Any) -> tuple[float, int]:
    """The scale and rank of an adapter's ``adapter_config.json`` (``lora_alpha / r``, ``/ sqrt(r)`` with
    ``use_rslora``); ``PushRefused`` naming the field when the config is not an object or ``r`` is not a positive
    integer or ``lora_alpha`` not a finite number."""
    if not isinstance(config, dict):
        raise PushRefused(f"the adapter's adapter_config.json is a JSON {type(config).__name__}, not an object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise PushRefused(f"the adapter's rank r is {rank!r}, not a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise PushRefused(f"the adapter's lora_alpha is {alpha!r}, not a finite number")
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank), rank


def merged(
    folder: str | os.PathLike, base: dict[str, torch.Tensor], specs: WeightSpecs
) -> list[tuple[str, torch.Tensor]]:
    """The weights to load for the adapter in ``folder`` over the unmerged ``base`` weights: each target
    ``base + scale * B @ A`` (the other weights unchanged), every matrix checked first (``PushRefused``)."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (OSError, ValueError, SafetensorError) as err:
        raise PushRefused(f"the adapter cannot be read ({type(err).__name__}: {str(err)[:200]})") from None
    scale, rank = lora_scale(config)
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise PushRefused(f"{name!r} is not a LoRA matrix (lora_A / lora_B)")
        if not bool(torch.isfinite(tensor).all()):
            raise PushRefused(f"{name!r} has {int((~torch.isfinite(tensor)).sum())} non-finite values (NaN or inf)")
        deltas.setdefault(f"{stem}.weight", {})[kind[0]] = tensor.float()
    out = dict(base)
    for target, pair in deltas.items():
        if target not in base or set(pair) != {"A", "B"}:
            raise PushRefused(f"{target!r}: not a served weight with both LoRA matrices")
        delta_shape = [pair["B"].shape[0], pair["A"].shape[1]]
        if pair["A"].shape[0] != rank or pair["B"].shape[1] != rank or delta_shape != list(base[target].shape):
            raise PushRefused(f"{target!r}: LoRA matrices {list(pair['A'].shape)} and {list(pair['B'].shape)} do not "
                              f"fit its shape {list(base[target].shape)} at rank {rank}")  # fmt: skip
        weight = base[target]
        out[target] = (weight.float() + scale * pair["B"] @ pair["A"]).to(weight.dtype)
    return specs.checked(out.items())
