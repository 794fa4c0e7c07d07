"""HFExportCallback: periodic and final Hugging Face exports, LoRA adapters or merged, atomic writes."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA
from dpo_utils import preference_data, preference_rows

from aitraining_pl.callbacks.export import HFExportCallback
from aitraining_pl.models import LoRAConfig
from aitraining_pl.modules.dpo import DPOModule


def _data(byte_tokenizer):
    rows = preference_rows(12)
    return preference_data(
        rows,
        byte_tokenizer,
        val_split=0,
        batch_size=4,
    )


def _fit(module, datamodule, callback, max_steps=3, **kwargs):
    trainer = pl.Trainer(
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **kwargs,
    )
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

    module = DPOModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, lora=LoRAConfig(r=4, alpha=8, dropout=0.0)
    )
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


# ------------------------------------------------------------------ hygiene (issue 13)
def test_leftovers_of_killed_runs_are_removed_when_fit_starts(tmp_path, byte_tokenizer):
    for name in (".step-3.tmp-x1y2", ".last.tmp-abc", ".last.old-1234", ".notes", "step-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    _fit(module, _data(byte_tokenizer), HFExportCallback(tmp_path, keep_last_k=None), max_steps=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes", "last", "step-1"]  # not ours: kept


def test_export_folders_follow_the_umask(tmp_path, byte_tokenizer):
    import os
    import stat

    old = os.umask(0o022)
    try:
        module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
        callback = HFExportCallback(tmp_path / "export")
        callback.export(module, "last")
        callback.export(module, "last")  # replaced: the new folder too
        callback.export(module, "step-1")
    finally:
        os.umask(old)
    for path in (tmp_path / "export", tmp_path / "export" / "last", tmp_path / "export" / "step-1"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path


def test_last_is_loadable_at_every_instant_while_it_is_replaced(tmp_path, monkeypatch):
    """Every file-system change made by the export (renames, swaps, removals) finds a complete ``last``."""
    import aitraining_pl.callbacks.export as export

    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    callback = HFExportCallback(tmp_path)
    callback.export(module, "last")
    seen = []

    def complete() -> bool:
        return (tmp_path / "last" / "config.json").is_file() and (tmp_path / "last" / "model.safetensors").is_file()

    def spy(function):
        def wrapped(*args, **kwargs):
            seen.append(complete())
            result = function(*args, **kwargs)
            seen.append(complete())
            return result

        return wrapped

    monkeypatch.setattr(export.os, "replace", spy(export.os.replace))
    monkeypatch.setattr(export.shutil, "rmtree", spy(export.shutil.rmtree))
    monkeypatch.setattr(export, "_exchange", spy(export._exchange))
    with torch.no_grad():
        module.policy.lm_head.weight.add_(1.0)
    callback.export(module, "last")
    assert seen and all(seen)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "last")
    assert torch.equal(loaded.lm_head.weight, module.policy.lm_head.weight)  # the new export is in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # the old one removed


def test_fallback_replacement_without_atomic_exchange(tmp_path, monkeypatch):
    import aitraining_pl.callbacks.export as export

    monkeypatch.setattr(export, "_exchange", lambda a, b: False)
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    callback = HFExportCallback(tmp_path)
    callback.export(module, "last")
    (tmp_path / "last" / "marker").write_text("old")
    callback.export(module, "last")
    assert not (tmp_path / "last" / "marker").exists() and (tmp_path / "last" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_fast_dev_run_exports_nothing(tmp_path, byte_tokenizer):
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    callback = HFExportCallback(tmp_path, every_n_train_steps=1)
    good = callback.export(module, "last")
    before = (good / "model.safetensors").read_bytes()
    trainer = pl.Trainer(
        fast_dev_run=2, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]
    )
    trainer.fit(DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2), _data(byte_tokenizer))
    assert trainer.global_step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert (good / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_plain_weights_equal_peft_unload_and_merge_and_load_with_transformers(tmp_path, tied):
    """``models.lora.plain_state_dict`` (no copy of the model: FSDP2 models cannot be deep-copied) gives what peft's
    ``merge_and_unload`` gives, ``modules_to_save`` included, and unmerged what it gives with every LoRA update
    zeroed (peft's own ``unload`` puts the untrained original of a ``modules_to_save`` module back from peft 0.22
    on, and the trained copy before: not a reference that holds across versions), and ``save_plain``'s folder reproduces
    the adapted model's logits. With tied embeddings and LoRA on the head, peft's merge writes the head's delta
    into the shared tensor, so the input embeddings change too and the merged model is not the adapted one; the
    merge here keeps the embeddings and writes the two untied."""
    import copy

    from transformers import AutoModelForCausalLM

    from aitraining_pl.models import LoRAConfig, apply_lora, build_causal_lm
    from aitraining_pl.models.lora import plain_state_dict, save_plain

    base = build_causal_lm({**TINY_LLAMA, "tie_word_embeddings": tied}, seed=0)
    targets = ["q_proj", "v_proj", "lm_head"] if tied else ["q_proj", "v_proj"]
    saved = None if tied else ["lm_head"]
    model = apply_lora(base, LoRAConfig(r=4, alpha=8, dropout=0.0, target_modules=targets, modules_to_save=saved))
    with torch.no_grad():  # adapters that change the model (lora_B starts at zero), and a trained lm_head copy
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.1)
    unmerged = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in unmerged.named_parameters():
            if "lora_B" in name:
                param.zero_()
    references = [(False, unmerged.merge_and_unload())] + (
        [] if tied else [(True, copy.deepcopy(model).merge_and_unload())]
    )
    for merged, reference in references:
        got, want = plain_state_dict(model, merged), reference.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, msg=key)
    save_plain(model, tmp_path, merged=True)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, model.eval()(ids).logits)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written.get("tie_word_embeddings", False) is False  # tied weights that the merge made differ: untied
    assert base.config.tie_word_embeddings == tied  # the live config is left as it was
