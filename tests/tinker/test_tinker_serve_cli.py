"""``aitraining-pl tinker-serve``: registered in the command, and its API keys: a new owner-only ``tml-`` key when
none is given, keys from a file, and one line refusing a key the tinker client would refuse."""

from __future__ import annotations

import os
import stat

import pytest

from aitraining_pl.cli import main
from aitraining_pl.tinker.serve import api_keys


def test_registered_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tinker-serve", "--help"])
    assert exit_info.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_api_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AITRAINING_PL_SERVER_TOKEN", raising=False)
    monkeypatch.delenv("AITRAINING_PL_SERVER_TOKEN_FILE", raising=False)
    (key,) = api_keys(None, str(tmp_path))
    assert key.startswith("tml-") and key not in capsys.readouterr().out
    assert stat.S_IMODE(os.stat(tmp_path / "api_key").st_mode) == 0o600
    (tmp_path / "keys").write_text("tml-one\n\ntml-two\n")
    assert api_keys(str(tmp_path / "keys"), str(tmp_path)) == ["tml-one", "tml-two"]
    (tmp_path / "bad").write_text("tml-one\nsecret\n")
    with pytest.raises(SystemExit, match=r"must start with 'tml-'.*\[1\]"):
        api_keys(str(tmp_path / "bad"), str(tmp_path))


TOKENS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def one_step(folder, checkpoints, precision):
    """A training client on an engine in ``precision``: its adapter's dtypes and plugin, the first
    forward_backward's loss and log-probs, and whether optim_step moved the adapter (``16-mixed``: within 12 rounds,
    since the GradScaler skips the steps whose scaled gradients overflow float16 while it halves its scale)."""
    import torch

    from aitraining_pl.tinker.engine import Engine, Lora, TrainedModel
    from aitraining_pl.tinker.wire import Datum, FwdBwd

    engine = Engine(folder, precision, "cpu", str(checkpoints))
    entry = TrainedModel("s:train:0", "owner", "client0", Lora(4))
    engine.run_create(entry, 0)
    params = engine.adapter_params("client0")
    data = [Datum(TOKENS[:-1], {"target_tokens": torch.tensor(TOKENS[1:]), "weights": torch.ones(len(TOKENS) - 1)})]
    before = [p.detach().clone() for p in params]
    outputs, metrics = engine.run_forward_backward(entry, FwdBwd("s:train:0", "cross_entropy", {}, data, False))
    engine.run_optim_step(entry, ADAM)
    moved = any(not torch.equal(a, b) for a, b in zip(params, before))  # B moves first (A: no gradient at B = 0)
    for _ in range(11 if precision == "16-mixed" else 0):
        if moved:
            break
        engine.run_forward_backward(entry, FwdBwd("s:train:0", "cross_entropy", {}, data, False))
        engine.run_optim_step(entry, ADAM)
        moved = any(not torch.equal(a, b) for a, b in zip(params, before))
    base = next(engine.model.get_base_model().model.parameters()).dtype
    return {p.dtype for p in params}, base, entry.precision, metrics["loss:sum"], outputs[0]["logprobs"], moved


@pytest.fixture(scope="module")
def fp32_step(tmp_path_factory):
    from tinker_fixtures import saved_model

    folder = saved_model(tmp_path_factory.mktemp("m"))
    return folder, one_step(folder, tmp_path_factory.mktemp("ck"), "32-true")


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "16-mixed"])
def test_each_precision_plugin_trains_fp32_adapters_close_to_fp32(fp32_step, tmp_path, precision):
    """Lightning's precision plugins: ``bf16-true`` keeps the base in bfloat16, the mixed ones keep float32 weights
    and run the forward under autocast (``16-mixed`` with a GradScaler of the client's own); every adapter stays
    float32, the loss is finite and near the float32 one, and a step moves the adapter."""
    import math

    import numpy as np
    import torch
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision

    folder, (_, _, _, loss32, logprobs32, _) = fp32_step
    dtypes, base, plugin, loss, logprobs, moved = one_step(folder, tmp_path, precision)
    assert dtypes == {torch.float32} and moved and math.isfinite(loss)
    assert base == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert isinstance(plugin, HalfPrecision if precision == "bf16-true" else MixedPrecision)
    assert (getattr(plugin, "scaler", None) is not None) == (precision == "16-mixed")
    if precision == "16-mixed":  # Tinker's loss is a sum (here ~60): x 2^16 overflows float16, the scale backs off
        assert plugin.scaler.get_scale() < 2.0**16
    assert loss == pytest.approx(loss32, rel=2e-2)
    assert np.abs(logprobs - logprobs32).max() < 0.1
