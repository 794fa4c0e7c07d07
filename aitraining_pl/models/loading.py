"""Loading causal LMs and tokenizers: from a local folder, a hub id, or an inline config (random init).

Loading from a hub id and from a folder is the same code path (``from_pretrained``); with
``HF_HUB_OFFLINE=1`` nothing reaches the network. ``trust_remote_code`` is off unless the caller sets it.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aitraining_pl.errors import ModelLoadError
from aitraining_pl.models.presets import resolve_model_config
from aitraining_pl.validation import hub_gguf_file, looks_like_path, names_gguf

#: The tokenizer name meaning "a byte-level tokenizer that needs no files" (``ByT5Tokenizer``).
BYTE_TOKENIZER = "byte"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16``; ``None`` or ``"auto"`` -> ``None``."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, padding_side: str = "right"):
    """A tokenizer from a folder or hub id, or ``"byte"`` for a file-free byte-level tokenizer.

    A missing pad token is set to the EOS token (or a new ``<pad>`` token when there is no EOS either).
    The returned tokenizer is a fresh object owned by the caller.
    """
    from transformers import AutoTokenizer, ByT5Tokenizer

    if name_or_path == BYTE_TOKENIZER:
        tokenizer = ByT5Tokenizer()
    else:
        folder, gguf = gguf_source(name_or_path)
        tokenizer = from_pretrained(
            AutoTokenizer.from_pretrained, folder, "tokenizer", trust_remote_code=trust_remote_code, **gguf
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
    tokenizer.padding_side = padding_side
    return tokenizer


def with_padding_side(tokenizer, side: str):
    """A shallow copy of ``tokenizer`` that pads on ``side`` ("left" for generation, "right" for
    training); the tokenizer someone else holds is not mutated."""
    if tokenizer.padding_side == side:
        return tokenizer
    clone = copy.copy(tokenizer)
    clone.padding_side = side
    return clone


def build_causal_lm(
    config: str | Mapping[str, Any], *, seed: int = 0, dtype: str | torch.dtype | None = None
) -> nn.Module:
    """A randomly initialised causal LM from an inline config dict, e.g.
    ``{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, ...}``, or a preset (``"tiny-llama"``,
    ``{"preset": "tiny-llama", ...overrides}``; see ``resolve_model_config``).

    Initialisation runs under ``torch.manual_seed(seed)`` inside a forked RNG state, so the same spec always
    gives the same weights and the caller's RNG stream is untouched.
    """
    return _build_from_config(resolve_model_config(config), "AutoModelForCausalLM", seed=seed, dtype=dtype)


def _build_from_config(config: Mapping[str, Any], auto_class: str, *, seed: int, dtype) -> nn.Module:
    import transformers

    config = dict(config)
    if "model_type" not in config:
        raise ValueError("an inline model_config needs a 'model_type' (e.g. 'llama'), got keys: " + ", ".join(config))
    model_type = config.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ModelLoadError("model_config.model_type", f"unknown model type {model_type!r} (e.g. 'llama', 'qwen2')")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, auto_class).from_config(hf_config)
    torch_dtype = resolve_dtype(dtype)
    return model.to(torch_dtype) if torch_dtype is not None else model


def load_causal_lm(
    model_name: str | None = None,
    model_config: Mapping[str, Any] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> nn.Module:
    """A causal LM from ``model_name`` (local folder, hub id or ``.gguf`` file: ``gguf_source``) or ``model_config``
    (inline, random init).

    Exactly one of the two must be given. The model comes in training mode, loaded or built (``from_pretrained``
    alone returns eval mode, which would train with dropout off). Calling this twice with the same arguments gives
    models with identical weights, which is how the frozen reference policy is built from its source.
    """
    return _load("AutoModelForCausalLM", model_name, model_config, dtype, attn_implementation, trust_remote_code, seed)


def load_backbone(
    model_name: str | None = None,
    model_config: Mapping[str, Any] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Like ``load_causal_lm`` but the bare trunk (``AutoModel``), encoder or decoder, for reward models."""
    return _load("AutoModel", model_name, model_config, dtype, attn_implementation, trust_remote_code, seed)


def _load(auto_class, model_name, model_config, dtype, attn_implementation, trust_remote_code, seed) -> nn.Module:
    if (model_name is None) == (model_config is None):
        raise ValueError("give exactly one of model_name (folder or hub id) and model_config (inline dict)")
    if model_config is not None:
        model_config = resolve_model_config(model_config)
        if attn_implementation is not None:
            model_config = {**model_config, "attn_implementation": attn_implementation}
        return _build_from_config(model_config, auto_class, seed=seed, dtype=dtype)
    import transformers

    model_name, gguf = gguf_source(model_name)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, **gguf}
    if dtype is not None:
        kwargs["dtype"] = resolve_dtype(dtype) or "auto"
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = from_pretrained(getattr(transformers, auto_class).from_pretrained, model_name, "model", **kwargs)
    if gguf:
        _drop_gguf_marks(model)
    return model.train()  # from_pretrained returns eval mode; the caller trains it (a frozen copy calls .eval())


def _drop_gguf_marks(model: nn.Module) -> None:
    """A model transformers read from a GGUF file holds dequantised float weights, but keeps the GGUF quantizer's
    marks (``hf_quantizer``, ``is_quantized``, ``config.quantization_config``), for which ``save_pretrained``
    refuses it ("quantized with gguf and is not serializable"): removed, so it exports like any model."""
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def gguf_source(name: str) -> tuple[str, dict[str, str]]:
    """``(folder or repo id, {"gguf_file": file name})`` for a ``.gguf`` file, a local one or one in a hub repo
    spelled ``org/repo/file.gguf`` (``validation.hub_gguf_file``): a model that exists only in llama.cpp's
    format, whose config, tokenizer and weights transformers reads, dequantised, with ``from_pretrained(folder,
    gguf_file=...)`` (needs the ``gguf`` package); else ``(name, {})``."""
    if not names_gguf(name):
        return name, {}
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    if (hub := hub_gguf_file(name)) is not None:
        return hub[0], {"gguf_file": hub[1]}
    raise ModelLoadError(name, "GGUF file not found")


def from_pretrained(load: Callable[..., Any], name: str, kind: str, **kwargs: Any) -> Any:
    """``load(name, **kwargs)`` (a ``from_pretrained``), with a missing folder, a hub id that cannot be
    reached and an unreadable or corrupt file raised as ``ModelLoadError`` naming the folder or file."""
    folder = os.path.expanduser(name)
    if looks_like_path(name) and not os.path.isdir(folder):
        parts = Path(folder).parts
        made_by = (
            f" (a run's export: train that run first, e.g. configs/quickstart/{parts[-3].removeprefix('quickstart-')}"
            ".yaml for runs/quickstart-*/export/last)"
            if len(parts) >= 3 and parts[-2] == "export" and parts[-3].startswith("quickstart-")
            else " (a run's export: train that run first)"
            if "export" in parts
            else ""
        )
        raise ModelLoadError(name, f"{kind} folder not found{made_by}")
    try:
        return load(name, **kwargs)
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, SafetensorError, ...: the user's file or id
        if not is_load_error(err):
            raise
        where = where_load_failed(folder, err) or name
        raise ModelLoadError(where, f"cannot load the {kind}: {one_line(err)}") from err


def is_load_error(err: Exception) -> bool:
    """Errors of reading a folder or hub id: OS errors, bad config or weights files (safetensors, JSON, a pickle
    that ``torch.load(weights_only=True)`` refuses)."""
    return isinstance(err, (OSError, ValueError, KeyError, pickle.UnpicklingError)) or type(err).__module__.startswith(
        "safetensors"
    )


def one_line(err: BaseException, limit: int = 300) -> str:
    """``"<Type>: <message>"`` on one line, at most ``limit`` characters of message; a pickle refused by
    ``weights_only`` loading is named by what it tried to load, without torch's advice to turn the check off."""
    if isinstance(err, pickle.UnpicklingError):
        found = re.search(r"(unsupported GLOBAL|Unsupported global:?) ([^\s]+)", str(err))
        what = f" ({found.group(1)} {found.group(2)})" if found else ""
        return f"refused by torch.load(weights_only=True): the file holds code or objects, not only tensors{what}"
    return f"{type(err).__name__}: {' '.join(str(err).split())[:limit]}"


def where_load_failed(folder: str, err: BaseException) -> str | None:
    """The weights file of ``folder`` when ``err`` is about reading weights (a corrupt safetensors file)."""
    weights_error = type(err).__module__.startswith("safetensors") or "safetensors" in str(err).lower()
    weights_error = weights_error or isinstance(err, pickle.UnpicklingError)
    return _weights_file(folder) if weights_error else (folder if os.path.isdir(folder) else None)


def _weights_file(folder: str) -> str | None:
    """The weights file of a local folder to name when loading it failed: the one safetensors file whose header
    does not read (a folder may hold several, e.g. a reward model's ``reward_head.safetensors``), else the
    folder's only weights file."""
    if not os.path.isdir(folder):
        return None
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith((".safetensors", ".bin"))]
    from safetensors import safe_open

    for path in files:
        if path.endswith(".safetensors"):
            try:
                with safe_open(path, framework="pt"):
                    pass
            except Exception:  # noqa: BLE001 - any failure to read the header names this file
                return path
    return files[0] if len(files) == 1 else None


def context_length_of(model: Any) -> int | None:
    """The longest sequence ``model`` (or its config) takes: ``max_position_embeddings``, which a vision-language
    config keeps in its ``text_config``; None when the config does not say."""
    config = getattr(model, "config", model)
    for candidate in (config, getattr(config, "get_text_config", lambda: None)()):
        value = getattr(candidate, "max_position_embeddings", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def hidden_size_of(model: nn.Module) -> int:
    """The hidden size of a transformers model (``config.hidden_size``, or ``d_model``/``n_embd``)."""
    config = model.config
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    text = getattr(config, "get_text_config", lambda: None)()
    if text is not None and getattr(text, "hidden_size", None):
        return int(text.hidden_size)
    raise ValueError(f"cannot find the hidden size in the config of {type(model).__name__}")
