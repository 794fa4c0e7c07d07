"""Shared data reading/validation and the learning-rate schedule."""

from __future__ import annotations

import json
import math

import pytest
import torch

from aitraining_pl.datamodules.io import DataValidationError, check_columns, check_text, pad_sequences, read_records
from aitraining_pl.optim import adamw_with_warmup, fused_adamw_applies, warmup_decay_factor


def test_read_jsonl_json_csv_and_errors(tmp_path):
    rows = [{"prompt": "p1", "chosen": "a"}, {"prompt": "p2", "chosen": "b"}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_records(str(jsonl)) == rows
    (tmp_path / "d.json").write_text(json.dumps({"prompt": ["p1", "p2"], "chosen": ["a", "b"]}))
    assert read_records(str(tmp_path / "d.json")) == rows
    (tmp_path / "d.csv").write_text("prompt,chosen\np1,a\np2,b\n")
    assert read_records(str(tmp_path / "d.csv")) == rows

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(DataValidationError, match=r"bad\.jsonl, row 2: malformed JSON"):
        read_records(str(bad))
    with pytest.raises(DataValidationError, match="file not found"):
        read_records(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataValidationError, match="unsupported file type"):
        read_records(str(tmp_path / "x.txt"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataValidationError, match="no rows"):
        read_records(str(tmp_path / "empty.jsonl"))


def test_column_and_text_checks():
    with pytest.raises(DataValidationError, match="missing column\\(s\\) 'rejected'; columns found: prompt, chosen"):
        check_columns([{"prompt": "a", "chosen": "b"}], ["prompt", "rejected"], "f.jsonl")
    with pytest.raises(DataValidationError, match="f.jsonl, row 3, field 'chosen': empty text"):
        check_text("  ", "f.jsonl", 3, "chosen")
    with pytest.raises(DataValidationError, match="got int"):
        check_text(5, "f.jsonl", 1, "prompt")
    with pytest.raises(DataValidationError, match="message 0"):
        check_text([{"role": "user"}], "f.jsonl", 1, "prompt")
    check_text([{"role": "user", "content": "hi"}], "f.jsonl", 1, "prompt")


def test_pad_sequences_both_sides():
    out = pad_sequences([[1, 2, 3], [4]], pad_value=0)
    assert out.tolist() == [[1, 2, 3], [4, 0, 0]]
    out = pad_sequences([[1, 2, 3], torch.tensor([4])], pad_value=9, side="left")
    assert out.tolist() == [[1, 2, 3], [9, 9, 4]]


def test_warmup_then_linear_and_cosine_decay():
    assert warmup_decay_factor(0, 100, 9) == pytest.approx(0.1)
    assert warmup_decay_factor(9, 100, 9) == pytest.approx(1.0)
    assert warmup_decay_factor(9 + 91 // 2, 100, 9, "linear") == pytest.approx(1 - 45 / 91)
    assert warmup_decay_factor(9 + 91 // 2, 100, 9, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 91)))
    assert warmup_decay_factor(100, 100, 9, "linear") == 0.0
    assert warmup_decay_factor(50, 100, 9, "constant") == 1.0
    with pytest.raises(ValueError, match="cosine"):
        warmup_decay_factor(0, 10, 0, "step")
    param = torch.nn.Parameter(torch.zeros(1))
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    conf = adamw_with_warmup([param, frozen], learning_rate=1.0, total_steps=10, warmup_ratio=0.2)
    assert len(conf["optimizer"].param_groups[0]["params"]) == 1
    assert conf["optimizer"].param_groups[0]["lr"] == pytest.approx(1 / 3)


def test_fused_adamw_takes_the_same_steps_and_applies_only_where_it_may():
    """Fused AdamW (one kernel per parameter, no parameter-sized temporaries) follows the same trajectory as the
    default one; it applies to plain floating-point tensors under plain precision only."""
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(5, 3, generator=g), [torch.randn(5, 3, generator=g) for _ in range(4)]
    weights = {}
    for fused in (False, True):
        param = torch.nn.Parameter(start.clone())
        conf = adamw_with_warmup([param], learning_rate=0.1, total_steps=4, weight_decay=0.01, fused=fused)
        assert bool(conf["optimizer"].defaults.get("fused")) is fused
        for grad in grads:
            param.grad = grad.clone()
            conf["optimizer"].step()
            conf["lr_scheduler"]["scheduler"].step()
        weights[fused] = param.detach()
    assert not torch.equal(weights[False], start)
    torch.testing.assert_close(weights[True], weights[False])
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_adamw_applies(params, plain_precision=True) == ("cpu" in _fused_devices())
    assert not fused_adamw_applies(params, plain_precision=False)  # Lightning's AMP plugins refuse clipping then
    assert not fused_adamw_applies([], plain_precision=True)


def _fused_devices() -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()
