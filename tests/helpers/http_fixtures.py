"""Shared by the HTTP server tests (``tests/generation/test_http_server.py``, ``tests/vllm_backend/test_vllm_http.py``):
the tiny servable policy saved as a folder a server starts from, and a LoRA policy over it whose adapter changes the
greedy samples."""

from __future__ import annotations

import copy

import torch
import transformers
from server_fixtures import SPEC

from aitraining_pl.models import build_causal_lm


def saved_policy(folder):
    """The tiny policy (``SPEC``, its head sharpened so that greedy never meets a near tie), its config and the byte
    tokenizer saved to ``folder``."""
    torch.manual_seed(0)
    model = build_causal_lm(SPEC).eval()
    with torch.no_grad():  # sharper than the random init: greedy ties are then unlikely
        model.lm_head.weight.mul_(20)
    model.config.save_pretrained(folder)
    transformers.ByT5Tokenizer().save_pretrained(folder)
    return model


def lora_policy(model):
    """A rank-4 LoRA policy over a copy of ``model`` whose adapter changes its greedy samples."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # a delta that changes the greedy samples
    return peft.eval()
