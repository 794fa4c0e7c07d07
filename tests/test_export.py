"""HFExportCallback: periodic and final Hugging Face exports, LoRA adapters or merged, atomic writes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from aitraining_pl.callbacks.export import HFExportCallback
from aitraining_pl.datamodules.preference import PreferenceDataModule
from aitraining_pl.models import LoRAConfig
from aitraining_pl.modules.dpo import DPOModule
from conftest import TINY_LLAMA
from dpo_utils import preference_rows


def _data(byte_tokenizer):
    rows = preference_rows(12)
    return PreferenceDataModule(prompts=[r["prompt"] for r in rows], chosen=[r["chosen"] for r in rows],
                                rejected=[r["rejected"] for r in rows], tokenizer=byte_tokenizer, val_split=0, batch_size=4)


def _fit(module, datamodule, callback, max_steps=3, **kwargs):
    trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback], **kwargs)
    trainer.fit(module, datamodule)
    return trainer


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_periodic_and_last_exports_load_with_from_pretrained(tmp_path, byte_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2)
    _fit(module, _data(byte_tokenizer), HFExportCallback(tmp_path, every_n_train_steps=1, keep_last_k=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-2", "step-3"]  # step-1 pruned, no temp dirs
    assert (tmp_path / "last" / "model.safetensors").is_file() and (tmp_path / "last" / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "last")
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(_logits(loaded, ids), _logits(module.policy, ids))
    step2 = AutoModelForCausalLM.from_pretrained(tmp_path / "step-2")
    assert not torch.equal(_logits(step2, ids), _logits(loaded, ids))  # the step-2 export is the step-2 policy
    assert AutoTokenizer.from_pretrained(tmp_path / "last")("ab", add_special_tokens=False)["input_ids"] == [100, 101]


@pytest.mark.parametrize("merge", [False, True])
def test_lora_adapters_or_merged(tmp_path, byte_tokenizer, merge):
    from transformers import AutoModelForCausalLM

    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2,
                       lora=LoRAConfig(r=4, alpha=8, dropout=0.0))
    _fit(module, _data(byte_tokenizer), HFExportCallback(tmp_path, merge_lora=merge), max_steps=2)
    files = {p.name for p in (tmp_path / "last").iterdir()}
    ids = torch.tensor([[5, 6, 7, 8]])
    module.policy.eval()
    if merge:
        assert {"model.safetensors", "config.json"} <= files and "adapter_config.json" not in files
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "last")
        torch.testing.assert_close(_logits(loaded, ids), _logits(module.policy, ids), rtol=1e-4, atol=1e-5)
        assert module.policy.peft_config  # the live model still has its adapters
    else:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files


def test_failed_export_keeps_the_previous_one(tmp_path, byte_tokenizer):
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    callback = HFExportCallback(tmp_path)
    good = callback.export(module, "last")
    before = (good / "model.safetensors").read_bytes()

    def broken(path, merge_lora=False):
        (path / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    module.save_pretrained = broken
    with pytest.raises(OSError, match="disk full"):
        callback.export(module, "last")
    assert (good / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last"]  # the temporary folder was removed


def test_failed_fit_writes_no_last(tmp_path, byte_tokenizer):
    class Boom(DPOModule):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    module = Boom(model_config=TINY_LLAMA, tokenizer_name="byte")
    with pytest.raises(RuntimeError, match="boom"):
        _fit(module, _data(byte_tokenizer), HFExportCallback(tmp_path, every_n_train_steps=1), max_steps=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
