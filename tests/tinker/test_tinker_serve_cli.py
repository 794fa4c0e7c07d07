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


def test_bf16_base_with_fp32_adapters_trains(tmp_path):
    """``--precision bf16-true``: the base in bfloat16, each adapter in float32; a step moves the adapter."""
    import torch
    from tinker_fixtures import saved_model

    from aitraining_pl.tinker.engine import Engine, Lora, TrainedModel
    from aitraining_pl.tinker.wire import Datum, FwdBwd

    engine = Engine(saved_model(tmp_path / "m"), "bf16-true", "cpu", str(tmp_path / "ck"))
    entry = TrainedModel("s:train:0", "owner", "client0", Lora(4))
    engine.run_create(entry, 0)
    params = engine.adapter_params("client0")
    assert params and all(p.dtype == torch.float32 for p in params)
    assert next(engine.model.get_base_model().model.parameters()).dtype == torch.bfloat16
    tokens = [72, 101, 108, 108, 111, 32]
    data = [Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(5)})]
    before = [p.detach().clone() for p in params]
    outputs, metrics = engine.run_forward_backward(entry, FwdBwd("s:train:0", "cross_entropy", {}, data, False))
    assert metrics["loss:sum"] > 0 and outputs[0]["logprobs"].shape == (5,)
    engine.run_optim_step(entry, {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                  "weight_decay": 0.0, "grad_clip_norm": 0.0})  # fmt: skip
    assert any(not torch.equal(a, b) for a, b in zip(params, before))  # B moves first (A has no gradient at B = 0)
