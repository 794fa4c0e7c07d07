"""Named inline model configs (random init) for tests and the quickstart recipes: ``model_config: {preset:
tiny-llama}`` in a YAML recipe, ``model_config="tiny-llama"`` in Python, instead of a copied config block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: named inline configs (random init) for tests and the quickstart recipes. ``tiny-llama``: a 2-layer Llama,
#: hidden size 64 (MLP 128), 4 attention heads over 2 key/value heads, the byte tokenizer's 384-token vocabulary
#: (pad 0, EOS 1, no BOS), 512 positions, untied embeddings; about 0.1M parameters.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    },
}


def resolve_model_config(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """An inline model config as a plain dict: a preset name (``"tiny-llama"``, see ``MODEL_PRESETS``), a dict
    naming a preset and overriding some of its values (``{"preset": "tiny-llama", "num_hidden_layers": 4}``, the
    form YAML recipes use), or a full transformers config dict (returned as a copy)."""
    if isinstance(config, str):
        config = {"preset": config}
    config = dict(config)
    preset = config.pop("preset", None)
    if preset is None:
        return config
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; must be one of {', '.join(sorted(MODEL_PRESETS))}")
    return {**MODEL_PRESETS[preset], **config}
