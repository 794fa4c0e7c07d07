"""Standard exports (issue 15, item 4): reward models as ``AutoModelForSequenceClassification`` folders, LoRA
exports that name a loadable base, the value-head loader, the model card and ``push_to_hub`` (offline)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
import yaml
from architectures import spec
from conftest import TINY_LLAMA
from dpo_utils import preference_data, preference_rows, write_jsonl

from aitraining_pl.callbacks.export import HFExportCallback
from aitraining_pl.callbacks.model_card import model_card
from aitraining_pl.datamodules.preference import PreferenceDataModule
from aitraining_pl.models import (
    LoRAConfig,
    MultiObjectiveRewardModel,
    PPOModel,
    RewardModel,
    RewardModelConfig,
    build_causal_lm,
    link_adapter_base,
    load_reward_model,
    load_value_head,
)
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.modules.reward import RewardModule

TINY_BERT = {
    "model_type": "bert",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
}
TEXTS = ["short", "a somewhat longer text", "mid length", "x"]


def _right_padded(lengths=(7, 3, 5, 1), vocab=96, pad=0, seed=0):
    """Right-padded random ids avoiding the special ids 0-2 (as TRL / vLLM batch reward inputs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n] = torch.randint(3, vocab, (n,), generator=g), 1
    return ids, mask


def _standard_scores(folder, ids, mask):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def _reward_model(model_config, **kw):
    model = RewardModel(RewardModelConfig(model_config=model_config, dropout_prob=0.0, **kw)).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    return model


# ------------------------------------------------------------------ reward models
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
def test_decoder_reward_model_loads_in_plain_transformers_with_the_same_scores(tmp_path, arch):
    model = _reward_model({"model_type": arch, **spec(arch)}, head_bias=False, temperature=2.0)
    ids, mask = _right_padded()
    expected = model.score(ids, mask).detach()
    folder = model.save_pretrained(tmp_path / "rm")
    meta = json.loads((folder / "reward_config.json").read_text())
    assert meta["weights"] == "sequence_classification" and meta["standard"]["exact"], meta["standard"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1
    torch.testing.assert_close(_standard_scores(folder, ids, mask), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(load_reward_model(folder).eval().score(ids, mask), expected)  # the project's loader: exact


def test_a_head_bias_is_the_recorded_constant_offset(tmp_path):
    model = _reward_model(TINY_LLAMA)
    with torch.no_grad():
        model.head.bias.fill_(0.75)
    ids, mask = _right_padded(vocab=384)
    expected = model.score(ids, mask).detach()
    folder = model.save_pretrained(tmp_path / "rm")
    record = json.loads((folder / "reward_config.json").read_text())["standard"]
    assert not record["exact"] and record["score_offset"] == pytest.approx(0.75)
    got = _standard_scores(folder, ids, mask) + record["score_offset"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(load_reward_model(folder).eval().score(ids, mask), expected)


def test_bert_reward_model_with_cls_pooling_loads_as_bert_for_sequence_classification(tmp_path):
    model = _reward_model(TINY_BERT, pooling_strategy="cls", temperature=0.5)
    ids, mask = _right_padded()
    expected = model.score(ids, mask).detach()
    folder = model.save_pretrained(tmp_path / "rm")
    record = json.loads((folder / "reward_config.json").read_text())["standard"]
    assert record["architecture"] == "BertForSequenceClassification" and record["layout"] == "tanh_pooler"
    torch.testing.assert_close(_standard_scores(folder, ids, mask), expected, rtol=1e-5, atol=1e-5)
    loaded = load_reward_model(folder).eval()  # the trunk's own (unused) pooler is restored from the extras
    assert torch.equal(loaded.score(ids, mask), expected)
    torch.testing.assert_close(loaded.trunk.pooler.dense.weight, model.trunk.pooler.dense.weight, rtol=0, atol=0)


def test_multi_objective_model_exports_its_combined_reward(tmp_path):
    model = MultiObjectiveRewardModel(
        RewardModelConfig(model_config=TINY_LLAMA, dropout_prob=0.0, head_bias=False),
        num_objectives=3,
        objective_weights=[0.5, 0.3, 0.2],
    ).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    ids, mask = _right_padded(vocab=384)
    expected = model.score(ids, mask).detach()
    folder = model.save_pretrained(tmp_path / "multi")
    torch.testing.assert_close(_standard_scores(folder, ids, mask), expected, rtol=1e-5, atol=1e-5)
    loaded = load_reward_model(folder).eval()
    assert type(loaded) is MultiObjectiveRewardModel
    per_objective = model(ids, mask, return_all_objectives=True)["rewards"]
    assert torch.equal(loaded(ids, mask, return_all_objectives=True)["rewards"], per_objective)  # every head kept


def test_mean_pooling_keeps_the_projects_format_and_old_folders_still_load(tmp_path, byte_tokenizer):
    model = _reward_model(TINY_LLAMA, pooling_strategy="mean", tokenizer_name="byte")
    folder = model.save_pretrained(tmp_path / "mean")
    meta = json.loads((folder / "reward_config.json").read_text())
    assert meta["weights"] == "project" and meta["standard"] is None
    assert load_reward_model(folder).predict_rewards(TEXTS) == model.predict_rewards(TEXTS)
    # a folder written before the standard layout (version 1: no weights/standard keys, no head_bias)
    old = model.save_pretrained(tmp_path / "old", standard=False)
    meta = json.loads((old / "reward_config.json").read_text())
    for key in ("weights", "standard"):
        del meta[key]
    del meta["config"]["head_bias"]
    meta["version"] = 1
    (old / "reward_config.json").write_text(json.dumps(meta))
    assert load_reward_model(old).predict_rewards(TEXTS) == model.predict_rewards(TEXTS)


def _preference_data(byte_tokenizer, path=None):
    rows = preference_rows(12)
    if path is not None:
        return PreferenceDataModule(
            data_path=str(write_jsonl(path, rows)), tokenizer=byte_tokenizer, val_split=0, batch_size=4
        )
    return preference_data(
        rows,
        byte_tokenizer,
        val_split=0,
        batch_size=4,
    )


def _fit(module, datamodule, callback, max_steps=2):
    trainer = pl.Trainer(
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, datamodule)
    return trainer


def test_trained_reward_module_export_is_a_plain_sequence_classifier(tmp_path, byte_tokenizer):
    module = RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2)
    _fit(module, _preference_data(byte_tokenizer), HFExportCallback(tmp_path / "out"))
    folder = tmp_path / "out" / "last"
    expected = torch.tensor(module.reward_model.eval().predict_rewards(TEXTS, byte_tokenizer))
    record = json.loads((folder / "reward_config.json").read_text())["standard"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)  # TRL-style use: the folder's class and tokenizer only
    enc = tokenizer([t + tokenizer.eos_token for t in TEXTS], padding=True, return_tensors="pt")
    got = _standard_scores(folder, enc["input_ids"], enc["attention_mask"]) + record["score_offset"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    card = (folder / "README.md").read_text()
    assert "reward-model" in card and "LlamaForSequenceClassification" in card


# ------------------------------------------------------------------ LoRA exports name a loadable base
def test_lora_export_of_an_inline_model_loads_offline_with_auto_peft(tmp_path, byte_tokenizer):
    from peft import AutoPeftModelForCausalLM

    module = DPOModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, lora=LoRAConfig(r=4, alpha=8, dropout=0.0)
    )
    _fit(module, _preference_data(byte_tokenizer), HFExportCallback(tmp_path / "out"))
    last = tmp_path / "out" / "last"
    config = json.loads((last / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((last / "base").resolve())  # the final folder, not the temp one
    assert (last / "base" / "model.safetensors").is_file()
    loaded = AutoPeftModelForCausalLM.from_pretrained(last).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    module.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, module.policy(input_ids=ids).logits)
    moved = tmp_path / "moved"
    last.rename(moved)
    assert link_adapter_base(moved) == str((moved / "base").resolve())
    assert AutoPeftModelForCausalLM.from_pretrained(moved) is not None


def test_lora_export_of_a_folder_model_names_that_folder(tmp_path, byte_tokenizer):
    base = tmp_path / "base_model"
    build_causal_lm(TINY_LLAMA).save_pretrained(base)
    byte_tokenizer.save_pretrained(base)
    module = DPOModule(model_name=str(base), lora=LoRAConfig(r=4, alpha=8, dropout=0.0))
    module.save_pretrained(tmp_path / "export")
    config = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and not (tmp_path / "export" / "base").exists()


# ------------------------------------------------------------------ value head
@pytest.mark.parametrize("lora", [False, True])
def test_ppo_export_loads_with_its_value_head(tmp_path, lora):
    module = PPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward=lambda p, r, m: [0.0] * len(r),
        lora=LoRAConfig(r=4, alpha=8, dropout=0.0) if lora else None,
    )
    with torch.no_grad():
        for param in module.model.value_head.parameters():
            param.normal_()
    module.save_pretrained(tmp_path / "export")
    head = load_value_head(tmp_path / "export")
    for key, value in module.model.value_head.state_dict().items():
        assert torch.equal(head.state_dict()[key], value)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    module.model.eval()
    loaded = PPOModel.from_pretrained(tmp_path / "export")
    with torch.no_grad():
        want, got = module.model(ids), loaded(ids)
    torch.testing.assert_close(got.values, want.values)
    torch.testing.assert_close(got.logits, want.logits)
    with pytest.raises(FileNotFoundError, match="value_head.safetensors"):
        load_value_head(tmp_path)


# ------------------------------------------------------------------ model card
def test_model_card_names_base_data_algorithm_hyperparameters_metrics_and_versions(tmp_path, byte_tokenizer):
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, beta=0.2)
    data = _preference_data(byte_tokenizer, tmp_path / "prefs.jsonl")
    trainer = _fit(module, data, HFExportCallback(tmp_path / "out"))
    card = (tmp_path / "out" / "last" / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["library_name"] == "transformers" and header["pipeline_tag"] == "text-generation"
    assert {"aitraining_pl", "dpo"} <= set(header["tags"]) and "base_model" not in header  # inline: no hub id
    assert "inline `llama` config" in card and str(tmp_path / "prefs.jsonl") in card
    assert "# DPOModule export" in card and ".tmp-" not in card  # not named after the temporary folder
    assert "aitraining_pl.modules.dpo.DPOModule" in card and "| beta | `0.2` |" in card
    loss = float(trainer.callback_metrics["train/loss"])
    assert f"| train/loss | {loss:.6g} |" in card
    import transformers

    assert f"- transformers {transformers.__version__}" in card


def test_model_card_header_names_hub_base_and_dataset():
    class Fake:
        hparams = {"model_name": "org/base-model", "lora": {"r": 8}}

    class Data:
        hparams = {"data_path": "org/prefs", "split": "train"}

    class Trainer:
        datamodule, callback_metrics, global_step = Data(), {"val/loss": torch.tensor(0.5)}, 7

    card = model_card("/nonexistent/export", Fake(), Trainer())
    header = yaml.safe_load(card.split("---")[1])
    assert header["base_model"] == "org/base-model" and header["datasets"] == ["org/prefs"]
    assert "lora" in header["tags"] and "| val/loss | 0.5 |" in card


# ------------------------------------------------------------------ push_to_hub (offline)
def test_push_to_hub_uploads_last_after_it_is_written(tmp_path, byte_tokenizer, monkeypatch):
    import huggingface_hub

    calls = []

    def create_repo(self, repo_id, private=False, exist_ok=False, **kw):
        calls.append(("create", repo_id, private, exist_ok))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}", endpoint="https://huggingface.co")

    def upload_folder(self, folder_path, repo_id, commit_message=None, **kw):
        assert (tmp_path / "out" / "last" / "model.safetensors").is_file()  # the export is complete first
        calls.append(("upload", folder_path, repo_id))

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    callback = HFExportCallback(tmp_path / "out", push_to_hub=True, hub_model_id="me/tiny-dpo", hub_private=True)
    _fit(module, _preference_data(byte_tokenizer), callback)
    assert calls == [("create", "me/tiny-dpo", True, True), ("upload", str(tmp_path / "out" / "last"), "me/tiny-dpo")]
    with pytest.raises(ValueError, match="hub_model_id"):
        HFExportCallback(tmp_path, push_to_hub=True)
