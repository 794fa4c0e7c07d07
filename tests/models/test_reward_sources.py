"""Reward-model sources for PPO: this project's folders and any one-label AutoModelForSequenceClassification
(own tokenizer and chat template, differing from the policy's); remote code only when the caller allows it."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.models.reward import RewardModel, RewardModelConfig, load_reward_model
from aitraining_pl.models.sequence_classifier import SequenceClassifierReward
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.rewards import RewardModelSource, build_reward_source
from aitraining_pl.rollout import GenerationConfig

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "hello", "world", "user", "assistant", ":"]
VOCAB += list("abcdefghijklmnopqrstuvwxyz0123456789.,!?") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
PROMPTS = ["hello world", "the cat", "a", "what is 2 + 2?"]
RESPONSES = ["hello there, world!", "sat", "b c d e f g h i j k", ""]
CHAT_TEMPLATE = "{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] }} [SEP]{% endfor %}"


def _bert_reward_folder(path, chat_template: str | None = None, num_labels: int = 1) -> str:
    """A tiny BERT sequence classifier with its own small word-piece vocabulary (not the policy's bytes)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(VOCAB)}, model_max_length=48)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=num_labels, pad_token_id=0, hidden_dropout_prob=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.mul_(20.0)
        model.classifier.weight.mul_(20.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _own_scores(folder: str, texts_or_pairs) -> list[float]:
    """The classifier's own score of each text, one at a time (no padding), in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = (
        AutoModelForSequenceClassification.from_pretrained(folder).eval(),
        AutoTokenizer.from_pretrained(folder),
    )
    out = []
    with torch.no_grad():
        for item in texts_or_pairs:
            enc = tokenizer(*item, return_tensors="pt") if isinstance(item, tuple) else tokenizer(
                item, add_special_tokens=False, return_tensors="pt")  # fmt: skip
            out.append(float(model(**enc).logits[0, 0]))
    return out


def test_pair_format_scores_equal_the_models_own(tmp_path):
    folder = _bert_reward_folder(tmp_path / "rm")
    source = build_reward_source(folder, kwargs={"batch_size": 3})
    assert isinstance(source, SequenceClassifierReward) and source.text_format == "pair"
    source.model.train()  # scoring must switch dropout off itself
    scores = source(PROMPTS, RESPONSES, [{}] * 4)
    assert scores == pytest.approx(_own_scores(folder, list(zip(PROMPTS, RESPONSES))), abs=1e-4)
    assert len(set(round(s, 4) for s in scores)) == 4  # the texts are told apart


def test_chat_template_format_and_truncation(tmp_path):
    folder = _bert_reward_folder(tmp_path / "rm", chat_template=CHAT_TEMPLATE)
    source = build_reward_source(folder)
    assert source.text_format == "chat" and source.max_length == 48
    long_response = "x " * 100
    prompts, responses = PROMPTS + ["hello"], RESPONSES + [long_response]
    texts = [
        source.tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                             tokenize=False)
        for p, r in zip(prompts, responses)
    ]  # fmt: skip
    assert texts[0] == "[CLS] user : hello world [SEP][CLS] assistant : hello there, world! [SEP]"
    expected = _own_scores(folder, texts[:4])
    assert source(prompts, responses, [{}] * 5)[:4] == pytest.approx(expected, abs=1e-4)
    assert source.encode(["hello"], [long_response])["input_ids"].shape[1] == 48  # truncated to its max length


def test_a_classifier_with_several_labels_is_refused(tmp_path):
    with pytest.raises(ValueError, match="one output label"):
        build_reward_source(_bert_reward_folder(tmp_path / "rm", num_labels=3))


def test_own_folder_is_still_this_projects_source(tmp_path, byte_tokenizer):
    model = RewardModel(RewardModelConfig(model_config=TINY_LLAMA, tokenizer_name="byte", dropout_prob=0.0))
    model.save_pretrained(tmp_path / "own")
    source = build_reward_source(str(tmp_path / "own"))
    assert isinstance(source, RewardModelSource)
    texts = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    assert source(PROMPTS, RESPONSES, [{}] * 4) == pytest.approx(
        load_reward_model(tmp_path / "own").predict_rewards(texts)
    )


def test_missing_reward_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_reward_source(str(tmp_path / "no" / "such" / "folder"))


def test_a_hub_id_is_loaded_from_the_hub(monkeypatch):
    """``org/name`` goes to the hub loader (offline here, so the hub's own not-found error), never to the
    import-path loader."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from aitraining_pl.rewards import RewardError

    with pytest.raises(RewardError) as info:
        build_reward_source("no-such-org-aitpl/no-such-reward-model")
    assert isinstance(info.value.__cause__, OSError)


# ------------------------------------------------------------------------------------------------ remote code
EVIL = "import os, pathlib\npathlib.Path(os.environ['AITPL_EVIL_MARKER']).write_text('ran')\n"
# subclasses, not the library's classes re-exported: loading remote code registers the loaded class for its
# auto class, which must not leak into the real classes (their later save_pretrained would copy code files)
EVIL_CLASSES = (
    "import transformers\n"
    "class EvilTokenizer(transformers.{tok}): pass\n"
    "class EvilConfig(transformers.{config}): pass\n"
    "class EvilModel(transformers.{model}):\n    config_class = EvilConfig\n"
)


def _plant_remote_code(folder, tokenizer_dir):
    """Make ``folder`` ask for remote code everywhere it can: reward_config.json, config.json's auto_map, a
    tokenizer named by tokenizer_name whose tokenizer_config.json has an auto_map."""
    os.makedirs(tokenizer_dir, exist_ok=True)
    for where in (folder, tokenizer_dir):
        with open(os.path.join(where, "evil.py"), "w") as f:
            f.write(EVIL + EVIL_CLASSES.format(tok="ByT5Tokenizer", config="LlamaConfig", model="LlamaModel"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}, f)
    meta_file = os.path.join(folder, "reward_config.json")
    meta = json.load(open(meta_file))
    meta["config"].update(trust_remote_code=True, tokenizer_name=str(tokenizer_dir), model_name=str(tokenizer_dir))
    json.dump(meta, open(meta_file, "w"))
    config = json.load(open(os.path.join(folder, "config.json")))
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    for name in os.listdir(folder):  # no tokenizer in the folder: loading falls back to tokenizer_name
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(folder, name))


def test_a_folder_asking_for_remote_code_does_not_run_it(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    marker = tmp_path / "marker"
    monkeypatch.setenv("AITPL_EVIL_MARKER", str(marker))
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = RewardModel(RewardModelConfig(model_config=TINY_LLAMA, tokenizer_name="byte", dropout_prob=0.0))
    folder = model.save_pretrained(tmp_path / "rm")
    _plant_remote_code(str(folder), str(tmp_path / "evil_tok"))

    loaded = load_reward_model(folder)
    assert loaded.config.trust_remote_code is False
    torch.testing.assert_close(loaded.head.weight, model.head.weight)
    with pytest.raises(ValueError, match="custom code"):
        loaded.get_tokenizer()  # the tokenizer needs its remote code: refused, not run
    with pytest.raises(ValueError, match="custom code"):
        build_reward_source(str(folder))  # refused when the source is built, before any training
    assert not marker.exists()

    # control: the same folder with remote code allowed by the caller does run it (so the test can see it)
    load_reward_model(folder, trust_remote_code=True).get_tokenizer()
    assert marker.read_text() == "ran"


def test_a_classifier_folder_asking_for_remote_code_does_not_run_it(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    marker = tmp_path / "marker"
    monkeypatch.setenv("AITPL_EVIL_MARKER", str(marker))
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = _bert_reward_folder(tmp_path / "rm")
    with open(os.path.join(folder, "evil.py"), "w") as f:
        f.write(
            EVIL + EVIL_CLASSES.format(tok="BertTokenizer", config="BertConfig", model="BertForSequenceClassification")
        )
    config = json.load(open(os.path.join(folder, "config.json")))
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForSequenceClassification": "evil.EvilModel"}
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    source = build_reward_source(folder)  # loads with the built-in BERT classes
    assert source(PROMPTS, RESPONSES, [{}] * 4) == pytest.approx(
        _own_scores(folder, list(zip(PROMPTS, RESPONSES))), abs=1e-4
    )
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ PPO
class _Recorder:
    """Wraps a reward source and keeps what it was asked and answered."""

    def __init__(self, source):
        self.source, self.calls = source, []

    def to(self, *args, **kwargs):
        self.source.to(*args, **kwargs)
        return self

    def __call__(self, prompts, responses, metadata):
        scores = self.source(prompts, responses, metadata)
        self.calls.append((list(prompts), list(responses), list(scores)))
        return scores


def test_ppo_with_a_sequence_classifier_reward_whose_tokenizer_differs(tmp_path, byte_tokenizer):
    folder = _bert_reward_folder(tmp_path / "rm")
    assert isinstance(PPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", reward=folder).reward_source,
                      SequenceClassifierReward)  # fmt: skip
    recorder = _Recorder(build_reward_source(folder))
    pl.seed_everything(0)
    module = PPOModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", reward=recorder, mini_batch_size=2, num_iterations=1,
        generation=GenerationConfig(max_new_tokens=6, temperature=1.0, top_p=1.0),
    )  # fmt: skip
    dm = PromptDataModule(
        prompts=["hello world", "the cat", "abc", "what is 2"], tokenizer=byte_tokenizer, batch_size=2
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, dm)
    assert len(recorder.calls) >= 2
    for prompts, responses, scores in recorder.calls:
        assert scores == pytest.approx(_own_scores(folder, list(zip(prompts, responses))), abs=1e-4)
    last_scores = recorder.calls[-1][2]
    assert float(trainer.callback_metrics["train/reward_mean"]) == pytest.approx(
        sum(last_scores) / len(last_scores), abs=1e-4
    )
