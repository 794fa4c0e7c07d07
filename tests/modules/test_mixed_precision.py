"""Mixed precision as a GPU runs it, simulated on the CPU (issue 41): the loss scaler of ``16-mixed`` (a CPU
``torch.amp.GradScaler`` through Lightning's ``MixedPrecision`` plugin built with it) and fp32 master weights
under ``*-mixed``."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer
from dpo_utils import preference_data, preference_rows
from lightning.pytorch.plugins.precision import MixedPrecision
from online_fixtures import EOS, fixed_rollout_module

from aitraining_pl.datamodules import PromptDataModule
from aitraining_pl.models import build_causal_lm
from aitraining_pl.modules import DPOModule

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


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in bf16 (transformers 5 loads it as bf16 unless told otherwise)."""
    path = tmp_path_factory.mktemp("bf16-llama")
    build_causal_lm(TINY_LLAMA, dtype="bfloat16").save_pretrained(str(path))
    return str(path)


def changed_fraction(model: torch.nn.Module, before: list[torch.Tensor]) -> float:
    """The share of ``model``'s weights that differ from ``before``, the input embedding left out (the rows of
    tokens absent from the batch get no gradient)."""
    embedding = model.get_input_embeddings().weight
    pairs = [(p, b) for p, b in zip(model.parameters(), before) if p is not embedding]
    return sum(int((p.detach() != b).sum()) for p, b in pairs) / sum(p.numel() for p, _ in pairs)


def dpo_step(tmp_path, checkpoint, byte_tokenizer, precision):
    module = DPOModule(model_name=checkpoint, tokenizer_name="byte", learning_rate=1e-5)
    before = [p.detach().float().clone() for p in module.policy.parameters()]
    data = preference_data(preference_rows(4), byte_tokenizer, batch_size=4, max_length=48, max_prompt_length=24)
    quiet_trainer(tmp_path, max_steps=1, precision=precision).fit(module, data)
    return module, before


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_trained_weights_are_fp32_master_weights(tmp_path, bf16_checkpoint, byte_tokenizer, precision):
    """Under ``bf16-mixed`` a bf16 checkpoint trains on fp32 master weights (autocast computes in bf16): AdamW's
    first step at lr 1e-5 moves every weight (in bf16 most updates would fall below an ulp); the frozen reference
    stays as loaded."""
    module, before = dpo_step(tmp_path, bf16_checkpoint, byte_tokenizer, precision)
    params = list(module.policy.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    state = module.trainer.optimizers[0].state
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    assert changed_fraction(module.policy, before) >= 0.99
    assert {p.dtype for p in module.reference.frozen_copy.parameters()} == {torch.bfloat16}


def test_bf16_true_trains_in_bf16_and_says_so(tmp_path, bf16_checkpoint, byte_tokenizer, caplog):
    with caplog.at_level("INFO"):
        module, _ = dpo_step(tmp_path, bf16_checkpoint, byte_tokenizer, "bf16-true")
    assert {p.dtype for p in module.policy.parameters()} == {torch.bfloat16}
    assert "bf16-true" in caplog.text and "no float32 master" in caplog.text
