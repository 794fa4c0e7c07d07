"""Mixed precision as a GPU runs it, simulated on the CPU (issue 41): the loss scaler of ``16-mixed`` (a CPU
``torch.amp.GradScaler`` through Lightning's ``MixedPrecision`` plugin built with it) and fp32 master weights
under ``*-mixed``."""

from __future__ import annotations

import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from online_fixtures import EOS, fixed_rollout_module

from aitraining_pl.datamodules import PromptDataModule

CLIP = torch.nn.utils.clip_grad_norm_
FIXED = torch.tensor([[40, 41, EOS, 0], [EOS, 0, 0, 0], [50, 51, 52, 53], [60, EOS, 70, 71]])


def cpu_loss_scaler(scale: float = 2.0**16) -> MixedPrecision:
    """``16-mixed`` with its loss scaler, on the CPU (Lightning itself turns ``16-mixed`` into bf16 there)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))


def clipped_norms(tmp_path, monkeypatch, byte_tokenizer, **trainer_options) -> list[float]:
    """The total gradient norm ``clip_grad_norm_`` saw at each optimizer step of one GRPO batch."""
    norms: list[float] = []

    def spy(parameters, max_norm, *args, **kwargs):
        norms.append(float(CLIP(parameters, max_norm, *args, **kwargs)))
        return torch.tensor(norms[-1])

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    module = fixed_rollout_module(
        monkeypatch, [1.0, 0.0, 0.25, 0.5], FIXED, num_generations=2, kl_coef=0.0, mini_batch_size=2,
        learning_rate=1e-3, max_grad_norm=1e-3,
    )  # fmt: skip
    dm = PromptDataModule(prompts=["hello", "a longer prompt"], tokenizer=byte_tokenizer, batch_size=2)
    quiet_trainer(tmp_path, limit_train_batches=1, **trainer_options).fit(module, dm)
    return norms


def test_manual_optimisation_clips_unscaled_gradients_once(tmp_path, monkeypatch, byte_tokenizer):
    """Under a loss scale of 2^16 the clip sees the gradients of ``32-true`` (not 65536 times them), and
    Lightning's own ``unscale_`` inside ``optimizer.step()`` does not run a second time (it would raise)."""
    plain = clipped_norms(tmp_path / "fp32", monkeypatch, byte_tokenizer)
    scaled = clipped_norms(tmp_path / "fp16", monkeypatch, byte_tokenizer, plugins=[cpu_loss_scaler()])
    assert len(plain) == len(scaled) == 2
    assert scaled == pytest.approx(plain, rel=0.05)


def test_clip_norm_is_the_same_under_the_three_precisions(tmp_path, monkeypatch, byte_tokenizer):
    plain = clipped_norms(tmp_path / "fp32", monkeypatch, byte_tokenizer)
    bf16 = clipped_norms(tmp_path / "bf16", monkeypatch, byte_tokenizer, precision="bf16-mixed")
    assert bf16 == pytest.approx(plain, rel=0.05)
