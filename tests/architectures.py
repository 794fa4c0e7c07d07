"""Tiny random configs of real transformers architectures (``AutoConfig.for_model``) for the matrix tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from aitraining_pl.models import build_causal_lm

VOCAB = 96
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
GPT2 = {
    "vocab_size": VOCAB,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: model type -> config overrides (the keys each config class understands)
ARCHITECTURES = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2": {},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3": {"head_dim": 8},
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 64, "final_logit_softcapping": 5.0},
    "gemma3_text": {"head_dim": 8, "sliding_window": 64, "final_logit_softcapping": 5.0},
    "phi": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attention_dropout": 0.1, "partial_rotary_factor": 0.5},
    "phi3": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attention_dropout": 0.1},
    "granite": {
        "logits_scaling": 4.0,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.25,
    },
    "olmo2": {},
    "cohere": {"logit_scale": 0.5},
    "gpt2": {**GPT2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
    "opt": {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "ffn_dim": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "word_embed_proj_dim": 32,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dropout": 0.1,
        "attention_dropout": 0.1,
    },
    "gpt_neox": {"rotary_pct": 0.5, "attention_dropout": 0.1, "hidden_dropout": 0.1},
    "stablelm": {"partial_rotary_factor": 0.5},
    "falcon": {
        "new_decoder_architecture": True,
        "num_kv_heads": 2,
        "alibi": False,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
    },
    "starcoder2": {"sliding_window": None},
    "falcon_h1": {
        "head_dim": 8,
        "mamba_d_ssm": 32,
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_n_groups": 1,
        "mamba_d_state": 8,
        "lm_head_multiplier": 0.3,
    },
}
#: architectures whose configs carry dropout (for the dropout tests)
WITH_DROPOUT = ("gpt2", "opt", "phi")


def arch_config(model_type: str):
    return AutoConfig.for_model(model_type, **spec(model_type))


def spec(model_type: str) -> dict:
    """The inline ``model_config`` dict (``model_type`` excluded) of the tiny ``model_type`` model."""
    return {**({} if model_type in ("gpt2", "opt") else COMMON), **ARCHITECTURES[model_type]}


def build_sharpened(model_type: str, seed: int = 0, scale: float = 8.0):
    """A randomly initialised model whose embeddings and head are scaled by ``scale`` (large logits, so
    small errors in log-probs show)."""
    return sharpen(build_causal_lm({"model_type": model_type, **spec(model_type)}, seed=seed), scale)


def sharpen(model, scale: float = 8.0):
    """Scale the input embeddings and the LM head of ``model`` in place by ``scale``."""
    with torch.no_grad():
        for module in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            module.weight.mul_(scale)
    return model
