"""Shared fixtures: offline environment, a tiny Llama spec and a byte-level tokenizer."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# tokenised data is cached by `datasets`: keep the suite's cache out of the user's
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="aitraining-pl-datasets-"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

#: A 2-layer Llama small enough to train in seconds on a CPU; 384 = the byte tokenizer's vocabulary.
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 384,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": None,
    "tie_word_embeddings": False,
}


@pytest.fixture
def tiny_config() -> dict:
    return dict(TINY_LLAMA)


@pytest.fixture(scope="session")
def byte_tokenizer():
    from aitraining_pl.models import load_tokenizer

    return load_tokenizer("byte")
