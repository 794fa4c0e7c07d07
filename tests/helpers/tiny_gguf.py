"""A tiny random Llama written as a GGUF file with the ``gguf`` package, laid out as llama.cpp's
``convert_hf_to_gguf.py`` lays out a Llama (its tensor names; q/k rows permuted, which transformers undoes when it
loads the file), float32 weights, no tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: Hugging Face name -> llama.cpp's, per block and at the top
BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (rotary halves interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(path: Path, model: torch.nn.Module) -> Path:
    """``model`` (a ``LlamaForCausalLM`` with untied embeddings) as a GGUF file at ``path``."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(float(getattr(c, "rope_theta", None) or 10000.0))
    writer.add_vocab_size(c.vocab_size)
    for key, value in model.state_dict().items():
        array = value.float().numpy()
        if key in TOP_NAMES:
            name = TOP_NAMES[key]
        else:
            block, part = key.split(".")[2], ".".join(key.split(".")[3:-1])
            name = f"blk.{block}.{BLOCK_NAMES[part]}.weight"
            if part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if part == "self_attn.q_proj" else c.num_key_value_heads
                array = _permute(array, heads)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
