"""The test suite's one table of tiny random configs of real transformers architectures (``ARCHITECTURES``): each row
names the uses it serves (the matrix of every model-facing path, the head post-processings, SFT, vLLM, ...), and a
test selects its rows with ``names(use, ...)``."""

from __future__ import annotations

from typing import NamedTuple

import torch

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

# The uses a row of the table serves (``names`` selects rows by them)
MATRIX = "matrix"  #: a real architecture of the matrix: every model-facing path is tested on these
HYBRID = "hybrid"  #: a hybrid state-space cache (no plain ``DynamicCache``; Mamba on slow reference kernels on CPU)
SLIDING = "sliding"  #: sliding-window attention layers in its cache (the episode decoder re-prefills each turn)
DROPOUT = "dropout"  #: its config carries dropout (the dropout tests)
HEAD = "head"  #: a post-processing of the LM head's output the fused head reproduces (``test_lm_head``)
SFT = "sft"  #: SFT's loss against the model's own cross-entropy, padded and packed (``test_sft``)
VLLM = "vllm"  #: vLLM serves it (``test_vllm_backend``)
MOE = "moe"  #: a mixture-of-experts decoder with top-k routers (routing replay: ``test_routing_replay``)


class Arch(NamedTuple):
    """One row of the table: config overrides (the keys its config class understands; ``model_type`` where the
    row's name is not one) and the uses it serves."""

    overrides: dict
    uses: frozenset[str]


def _row(overrides: dict, *uses: str) -> Arch:
    return Arch(overrides, frozenset(uses))


#: name -> tiny random config of a real transformers architecture and its uses: the one table of the test suite
ARCHITECTURES: dict[str, Arch] = {
    "llama": _row({}, MATRIX, HEAD, SFT, VLLM),
    "mistral": _row({"sliding_window": None}, MATRIX, VLLM),
    "mixtral": _row({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, MATRIX, MOE),
    "qwen2": _row({}, MATRIX, SFT, VLLM),
    "qwen2_moe": _row(
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        MATRIX,
        MOE,
    ),
    "qwen3": _row({"head_dim": 8}, MATRIX, VLLM),
    "gemma": _row({"head_dim": 8}, MATRIX, VLLM),
    "gemma2": _row({"head_dim": 8, "sliding_window": 64, "final_logit_softcapping": 5.0}, MATRIX, SLIDING, SFT),
    "gemma3_text": _row({"head_dim": 8, "sliding_window": 64, "final_logit_softcapping": 5.0}, MATRIX, SLIDING),
    "phi": _row(
        {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attention_dropout": 0.1, "partial_rotary_factor": 0.5},
        MATRIX,
        DROPOUT,
    ),
    "phi3": _row({"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attention_dropout": 0.1}, MATRIX, VLLM),
    "granite": _row(
        {
            "logits_scaling": 4.0,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.25,
        },
        MATRIX,
    ),
    "olmo2": _row({}, MATRIX),
    "cohere": _row({"logit_scale": 0.5}, MATRIX),
    "gpt2": _row({**GPT2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}, MATRIX, DROPOUT, SFT),
    "opt": _row(
        {
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
        MATRIX,
        DROPOUT,
    ),
    "gpt_neox": _row({"rotary_pct": 0.5, "attention_dropout": 0.1, "hidden_dropout": 0.1}, MATRIX, VLLM),
    "stablelm": _row({"partial_rotary_factor": 0.5}, MATRIX),
    "falcon": _row(
        {
            "new_decoder_architecture": True,
            "num_kv_heads": 2,
            "alibi": False,
            "hidden_dropout": 0.1,
            "attention_dropout": 0.1,
        },
        MATRIX,
    ),
    "starcoder2": _row({"sliding_window": None}, MATRIX),
    "falcon_h1": _row(
        {
            "head_dim": 8,
            "mamba_d_ssm": 32,
            "mamba_n_heads": 4,
            "mamba_d_head": 8,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "lm_head_multiplier": 0.3,
        },
        MATRIX,
        HYBRID,
    ),
    "qwen3_moe": _row({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8}, MOE),
    "olmoe": _row({"num_experts": 4, "num_experts_per_tok": 2}, MOE),
    "deepseek_v3": _row(
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "n_shared_experts": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
        },
        MOE,
    ),
    # variants of a matrix row: strong head post-processings, so a fused head that skipped one would show
    "llama_tied": _row({"model_type": "llama", "tie_word_embeddings": True}, HEAD),
    "granite_divide": _row({"model_type": "granite", "logits_scaling": 0.05}, HEAD),
    "cohere_multiply": _row({"model_type": "cohere", "logit_scale": 8.0}, HEAD),
    "gemma2_softcap": _row({"model_type": "gemma2", "final_logit_softcapping": 0.05, "head_dim": 8}, HEAD),
}


def names(*uses: str, without: tuple[str, ...] = ()) -> list[str]:
    """The rows serving every one of ``uses`` and none of ``without``, in the table's order."""
    return [
        name for name, row in ARCHITECTURES.items() if row.uses.issuperset(uses) and not row.uses.intersection(without)
    ]


#: architectures whose configs carry dropout (for the dropout tests)
WITH_DROPOUT = tuple(names(DROPOUT))


def model_type(name: str) -> str:
    """The transformers model type of row ``name``."""
    return ARCHITECTURES[name].overrides.get("model_type", name)


def spec(name: str) -> dict:
    """The inline ``model_config`` dict (``model_type`` excluded) of the tiny model of row ``name``."""
    overrides = {k: v for k, v in ARCHITECTURES[name].overrides.items() if k != "model_type"}
    return {**({} if model_type(name) in ("gpt2", "opt") else COMMON), **overrides}


def model_config(name: str) -> dict:
    """The inline ``model_config`` dict (``model_type`` included) of the tiny model of row ``name``."""
    return {"model_type": model_type(name), **spec(name)}


def build_sharpened(name: str, seed: int = 0, scale: float = 8.0):
    """A randomly initialised model of row ``name`` whose embeddings and head are scaled by ``scale`` (large
    logits, so small errors in log-probs show)."""
    return sharpen(build_causal_lm(model_config(name), seed=seed), scale)


def sharpen(model, scale: float = 8.0):
    """Scale the input embeddings and the LM head of ``model`` in place by ``scale``."""
    with torch.no_grad():
        for module in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            module.weight.mul_(scale)
    return model
