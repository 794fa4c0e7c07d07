"""Shared by the vLLM backend's tests (``test_vllm_backend.py``,
``test_vllm_episodes.py``): the matrix's configs at the width vLLM's CPU attention needs, the largest log-prob gap
between an engine and the policy, and a few training steps that move every weight. Imports no vLLM itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from architectures import spec

from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.rollout import RolloutEngine

if TYPE_CHECKING:
    from aitraining_pl.generation.vllm import VLLMEngine

#: vLLM's CPU attention needs head sizes of 32 or more: two heads of 32 over the byte tokenizer's vocabulary
WIDER = {"vocab_size": 384, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": 1}


def vllm_spec(model_type: str) -> dict:
    """The matrix's tiny ``model_type`` config with two heads of 32 and the byte vocabulary."""
    config = {"model_type": model_type, **spec(model_type), **WIDER}
    if "head_dim" in config:
        config["head_dim"] = 32
    return config


def prompts(tokenizer, texts):
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def logp_gap(engine: VLLMEngine, model, tokenizer, generation) -> float:
    """Largest |logp_vllm - logp_policy| over the response tokens of a sampled rollout (fp32, temperature 1)."""
    ids, mask = prompts(tokenizer, ["hello there", "what is two plus two"])
    rollout = RolloutEngine(tokenizer, generation, backend=engine).sample(model, ids, mask, 4, seed=0)
    with torch.no_grad():
        trainer = response_logps(model.eval(), rollout.input_ids, rollout.attention_mask, ids.shape[1], 1.0).logprobs
    return float(((rollout.sampling_logprobs - trainer).abs() * rollout.response_mask).max())


def train_steps(model, k: int = 3, lr: float = 0.05) -> None:
    """``k`` AdamW steps of next-token loss on a fixed text (changes every trainable weight)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    data = torch.arange(3, 40).view(1, -1)
    model.train()
    for _ in range(k):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
