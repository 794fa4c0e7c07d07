"""SFTModule and SFTDataModule: the loss against the model's own cross-entropy (padded and packed), the loss
masks of every data layout, data errors, learning, the export and SFT -> DPO end to end."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch
from architectures import SFT, model_config, names
from conftest import TINY_LLAMA
from dpo_utils import read_metrics, series, write_config, write_jsonl

from aitraining_pl import SFTDataModule, SFTModule
from aitraining_pl.cli import build_cli
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.losses import sft_loss
from aitraining_pl.models import LoRAConfig, build_causal_lm, load_tokenizer
from aitraining_pl.models.scoring import pack_rows, scoring_path, token_logps

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = "</s>"  # the byte tokenizer's EOS (id 1)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Sky?"},
    {"role": "assistant", "content": "Blue."},
]


@pytest.fixture
def chat_tokenizer():
    tokenizer = load_tokenizer("byte")
    tokenizer.chat_template = CHATML
    return tokenizer


def batch_of(tokenizer, rows, completion_only_loss=True, max_length=256):
    dm = SFTDataModule(
        rows=rows,
        tokenizer=tokenizer,
        val_split=0,
        batch_size=len(rows),
        shuffle=False,
        completion_only_loss=completion_only_loss,
        max_length=max_length,
    )
    dm.setup()
    return next(iter(dm.train_dataloader()))


def scored_text(tokenizer, batch, row=0):
    ids = batch["input_ids"][row][batch["completion_mask"][row].bool()]
    return tokenizer.decode(ids)


def full_text(tokenizer, batch, row=0):
    return tokenizer.decode(batch["input_ids"][row][batch["attention_mask"][row].bool()])


# ------------------------------------------------------------------ the loss
def scored_logps(model, batch, padding_free=True):
    """(B, L - 1) log-probs of the scored tokens (0 elsewhere) and the (B, L - 1) mask, as SFTModule scores."""
    scored = batch["completion_mask"].bool() & batch["attention_mask"].bool()
    packed = pack_rows(batch) if padding_free else None
    return token_logps(model, batch["input_ids"], batch["attention_mask"], scored, packed=packed), scored[:, 1:]


def test_sft_loss_is_the_mean_token_nll():
    logps = torch.tensor([[-1.0, -2.0, -5.0], [-6.0, -7.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(sft_loss(logps, mask)) == pytest.approx(3.0)  # (1 + 2 + 6) / 3: tokens weigh the same
    empty = logps.clone().requires_grad_()
    nothing = sft_loss(empty, torch.zeros(2, 3))
    assert float(nothing.detach()) == 0.0 and nothing.requires_grad


# rows of lengths 4, 2 and 5 with scored tokens 7, 1 | 3 | 6 and 9, 1 (row 2: two separate turns)
HAND_BATCH = {
    "input_ids": torch.tensor([[5, 6, 7, 1, 0], [4, 3, 0, 0, 0], [5, 6, 8, 9, 1]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]),
    "completion_mask": torch.tensor([[0, 0, 1, 1, 0], [1, 1, 0, 0, 0], [0, 1, 0, 1, 1]]),
}


def test_pack_rows_layout():
    packed = pack_rows(HAND_BATCH)
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 4, 3, 5, 6, 8, 9, 1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]]
    assert packed.plan.blocks == [(((0, 4),), 4), (((4, 6),), 2), (((6, 11),), 5)]
    assert packed.targets.tolist() == [7, 1, 3, 6, 9, 1]  # row 1's first token is never predicted
    assert packed.sources.tolist() == [1, 2, 4, 6, 8, 9]
    assert packed.sequences.tolist() == [0, 0, 1, 2, 2, 2]
    assert packed.columns.tolist() == [2, 3, 1, 1, 3, 4]


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("arch", names(SFT))
def test_loss_equals_the_model_cross_entropy(arch, padding_free):
    """The loss is the model's own causal-LM cross-entropy with labels -100 off the scored tokens, with the
    same gradients, padded or packed, on every architecture (unsupported ones fall back to padded rows)."""
    model = build_causal_lm(model_config(arch), seed=0)
    model.eval()  # no dropout: both forwards must see the same network
    labels = HAND_BATCH["input_ids"].masked_fill(
        ~(HAND_BATCH["completion_mask"].bool() & HAND_BATCH["attention_mask"].bool()), -100
    )
    want = model(input_ids=HAND_BATCH["input_ids"], attention_mask=HAND_BATCH["attention_mask"], labels=labels).loss
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logps, mask = scored_logps(model, HAND_BATCH, padding_free=padding_free)
    got = sft_loss(logps, mask)
    got.backward()
    assert torch.equal(logps != 0, mask.bool())
    if arch == "llama":
        assert scoring_path(model).packed  # the packed path is taken where it is exact
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip((p.grad for p in model.parameters()), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_loss_equals_a_hand_loop(byte_tokenizer):
    """-mean over scored tokens of log_softmax(logits[t - 1])[token t], written out row by row."""
    rows = [{"prompt": "What is 2+2?", "completion": "Four."}, {"prompt": "Hi", "completion": "Hello there!"}]
    batch = batch_of(byte_tokenizer, rows)
    module = SFTModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms = []
    for i in range(2):
        for t in range(1, int(batch["attention_mask"][i].sum())):
            if batch["completion_mask"][i, t]:
                terms.append(-torch.log_softmax(logits[i, t - 1], -1)[batch["input_ids"][i, t]])
    assert len(terms) == len("Four.") + len("Hello there!") + 2  # + one EOS each
    torch.testing.assert_close(
        sft_loss(*scored_logps(module.policy, batch)), torch.stack(terms).mean(), rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------------------ data layouts and masks
@pytest.mark.parametrize("completion_only_loss", [True, False], ids=["completion-only", "all-tokens"])
def test_masks_of_each_layout(chat_tokenizer, completion_only_loss):
    text = batch_of(chat_tokenizer, [{"text": "The sky is blue."}], completion_only_loss)
    pc = batch_of(chat_tokenizer, [{"prompt": "The sky is", "completion": " blue."}], completion_only_loss)
    pc_chat = batch_of(
        chat_tokenizer,
        [{"prompt": [{"role": "user", "content": "Sky?"}], "completion": [{"role": "assistant", "content": "Blue."}]}],
        completion_only_loss,
    )
    chat = batch_of(chat_tokenizer, [{"messages": CONVERSATION}], completion_only_loss)
    rendered = chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert full_text(chat_tokenizer, text) == "The sky is blue." + EOS  # EOS appended
    assert full_text(chat_tokenizer, pc) == "The sky is blue." + EOS
    assert full_text(chat_tokenizer, pc_chat) == (
        "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n"
    )  # the model's own template ended the turn: no EOS after it (as TRL)
    assert full_text(chat_tokenizer, chat) == rendered
    if completion_only_loss:
        assert scored_text(chat_tokenizer, text) == "The sky is blue." + EOS  # plain text: every token
        assert scored_text(chat_tokenizer, pc) == " blue." + EOS
        assert scored_text(chat_tokenizer, pc_chat) == "Blue.<|im_end|>\n"
        # both assistant turns with their end-of-turn markup; system and user turns and headers unscored
        assert scored_text(chat_tokenizer, chat) == "Hello.<|im_end|>\n" + "Blue.<|im_end|>\n"
    else:
        for batch in (text, pc, pc_chat, chat):
            assert torch.equal(batch["completion_mask"], batch["attention_mask"])


def test_conversations_without_a_chat_template_use_the_fallback(byte_tokenizer):
    batch = batch_of(byte_tokenizer, [{"messages": CONVERSATION[1:]}])
    assert full_text(byte_tokenizer, batch).startswith("<|user|>\nHi\n<|assistant|>\nHello.\n")
    assert scored_text(byte_tokenizer, batch) == "Hello.\n" + "Blue.\n" + EOS


def test_a_conversation_ending_with_a_user_turn_leaves_its_eos_unscored(chat_tokenizer):
    batch = batch_of(chat_tokenizer, [{"messages": CONVERSATION[1:4]}])
    assert scored_text(chat_tokenizer, batch) == "Hello.<|im_end|>\n"


HIDING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|a|>(hidden)\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_turns_a_template_rewrites_are_left_unscored(byte_tokenizer):
    """A template that hides earlier assistant turns: only the turn it renders as it is learnt is scored."""
    tokenizer = load_tokenizer("byte")
    tokenizer.chat_template = HIDING
    batch = batch_of(tokenizer, [{"messages": CONVERSATION[1:]}])
    assert full_text(tokenizer, batch) == "<|user|>Hi\n<|a|>(hidden)\n<|user|>Sky?\n<|assistant|>Blue.\n"
    assert scored_text(tokenizer, batch) == "Blue.\n"
    with pytest.raises(DataValidationError, match="row 1, field 'messages': the chat template renders no assistant"):
        batch_of(tokenizer, [{"messages": CONVERSATION[1:4]}])


def test_truncation_keeps_the_start_and_drops_rows_with_nothing_to_learn(byte_tokenizer, caplog):
    rows = [{"prompt": "p" * 10, "completion": "abcdef"}, {"prompt": "q" * 30, "completion": "x"}]
    batch = batch_of(byte_tokenizer, rows, max_length=13)
    assert batch["input_ids"].shape == (1, 13)  # the second row (prompt beyond max_length) was dropped
    assert scored_text(byte_tokenizer, batch) == "abc"
    assert "dropped 1 of 2 row(s)" in caplog.text
    with pytest.raises(DataValidationError, match="no usable rows"):
        batch_of(byte_tokenizer, rows[1:], max_length=13)


@pytest.mark.parametrize(
    "rows, expected",
    [
        (
            [{"question": "a"}],
            "no SFT columns: expected 'messages', 'prompt' + 'completion', or 'text'; columns found: question",
        ),
        ([{"prompt": "a"}], "missing column(s) 'completion'"),
        ([{"text": "a"}, {"txt": "b"}], "row 2, field 'text': missing field"),
        ([{"text": "a"}, {"text": "  "}], "row 2, field 'text': empty text"),
        ([{"text": [{"role": "user", "content": "a"}]}], "row 1, field 'text': expected a non-empty string, got list"),
        ([{"messages": "hello"}], "row 1, field 'messages': expected a list of {role, content} messages"),
        ([{"messages": [{"role": "user"}]}], "row 1, field 'messages': message 0 is not a {role, content} dict"),
        (
            [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "a"}]}],
            "row 2, field 'messages': no assistant message",
        ),
    ],
)
def test_bad_rows_are_named(byte_tokenizer, rows, expected):
    with pytest.raises(DataValidationError) as info:
        batch_of(byte_tokenizer, rows)
    assert expected in str(info.value)


def test_bad_file_row_is_named_through_the_cli(tmp_path, capsys):
    from aitraining_pl.cli import main

    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}])
    config = sft_config(tmp_path, path)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config)])
    assert info.value.code == 2
    assert f"{path}, row 2, field 'completion': empty text" in capsys.readouterr().err


# ------------------------------------------------------------------ training, metrics, export
TOPICS = {"gravity": "a pull", "an atom": "a tiny unit", "the moon": "a satellite", "a volcano": "a mountain"}


def topic_rows(n: int) -> list[dict]:
    names = list(TOPICS)
    return [{"prompt": f"What is {names[i % 4]}?", "completion": f" It is {TOPICS[names[i % 4]]}."} for i in range(n)]


def sft_config(tmp_path, data_path, model=None, trainer=None, data=None):
    """A CLI config for a tiny SFT run (the DPO test config with SFT classes)."""
    config = json.loads(write_config(tmp_path, model=model, trainer=trainer, data=data).read_text())
    config["model"]["class_path"] = "aitraining_pl.modules.sft.SFTModule"
    config["data"]["class_path"] = "aitraining_pl.datamodules.sft.SFTDataModule"
    config["data"]["init_args"] = {
        "data_path": str(data_path),
        "val_split": 0.25,
        "batch_size": 4,
        "max_length": 64,
        **(data or {}),
    }
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_metrics_val_loss_is_token_weighted_and_perplexity_its_exp(tmp_path, byte_tokenizer):
    path = write_jsonl(tmp_path / "sft.jsonl", topic_rows(16))
    config = sft_config(tmp_path, path, trainer={"max_steps": 2, "val_check_interval": 2}, data={"shuffle": False})
    cli = build_cli(["fit", "--config", str(config)])
    rows = read_metrics(tmp_path)
    # train/num_tokens: real tokens trained on so far (the first 4 rows, then 8, in file order)
    lengths = cli.datamodule.train_dataset.lengths()
    assert series(rows, "train/num_tokens") == [sum(lengths[:4]), sum(lengths[:8])]
    assert cli.model.num_tokens == sum(lengths[:8])
    # val/loss: the mean NLL over every scored validation token (not a mean of batch means)
    dm, module = cli.datamodule, cli.model
    module.eval()
    with torch.no_grad():
        scores = [scored_logps(module.policy, b) for b in dm._loader(dm.val_dataset, 3)]
    nll = -sum(float(logps.sum()) for logps, _ in scores) / sum(int(mask.sum()) for _, mask in scores)
    val_loss, val_ppl = series(rows, "val/loss")[-1], series(rows, "val/perplexity")[-1]
    assert val_loss == pytest.approx(nll, rel=1e-4)
    assert val_ppl == pytest.approx(math.exp(val_loss), rel=1e-5)


@pytest.mark.slow
def test_sft_learns_held_out_loss_falls_and_the_export_feeds_dpo(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", topic_rows(64))
    export = tmp_path / "export"
    config = sft_config(
        tmp_path,
        path,
        model={"learning_rate": 1e-2},
        trainer={
            "max_steps": 36,
            "val_check_interval": 12,
            "callbacks": [
                {"class_path": "aitraining_pl.callbacks.export.HFExportCallback", "init_args": {"dirpath": str(export)}}
            ],
        },
    )
    before = float(build_cli(["validate", "--config", str(config)]).trainer.callback_metrics["val/loss"])
    cli = build_cli(["fit", "--config", str(config)])
    val = series(read_metrics(tmp_path), "val/loss")
    assert before > 5.0 and val[-1] < 0.5 * before and val[-1] < val[0]
    # the export is a plain transformers folder with the trained weights
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(export / "last").eval()
    batch = next(iter(cli.datamodule.val_dataloader()))
    cli.model.policy.eval()
    with torch.no_grad():
        want = cli.model.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, want)
    # SFT -> DPO: the export is DPOModule's model_name (tokenizer from the same folder); a few steps train
    dpo_dir = tmp_path / "dpo"
    dpo_dir.mkdir()
    dpo_config = write_config(
        dpo_dir,
        model={"model_name": str(export / "last"), "model_config": None, "tokenizer_name": None},
        trainer={"max_steps": 3},
    )
    dpo = build_cli(["fit", "--config", str(dpo_config)])
    assert dpo.trainer.global_step == 3 and len(series(read_metrics(dpo_dir), "train/loss")) >= 3
    start = AutoModelForCausalLM.from_pretrained(export / "last").state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in dpo.model.policy.state_dict().items())


def test_lora_trains_only_adapters_and_exports_them(tmp_path, byte_tokenizer):
    module = SFTModule(
        model_config=TINY_LLAMA, tokenizer_name="byte", lora=LoRAConfig(r=4, alpha=8, dropout=0.0), learning_rate=1e-2
    )
    assert module.hparams.lora["r"] == 4
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    dm = SFTDataModule(rows=topic_rows(8), tokenizer=byte_tokenizer, val_split=0, batch_size=4)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, dm)
    module.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_quickstart_config_runs_briefly(tmp_path, monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    data = root / "aitraining_pl" / "data" / "quickstart_sft.jsonl"
    build_cli(
        [
            "fit",
            "--config",
            str(root / "configs/quickstart/sft.yaml"),
            "--data.init_args.data_path",
            str(data),
            "--trainer.max_steps",
            "3",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    assert list((tmp_path / "runs/quickstart-sft/csv").glob("version_*/metrics.csv"))
    assert (tmp_path / "runs/quickstart-sft/export/last/model.safetensors").is_file()


@pytest.mark.slow
def test_sft_reward_ppo_pipeline_through_the_quickstart_configs(tmp_path, monkeypatch):
    """The docs' SFT -> reward model -> PPO commands, each stage a few steps: the SFT export is the reward
    model's trunk and PPO's policy and reference, the reward-model export PPO's reward."""
    import csv
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    data, quiet = root / "aitraining_pl" / "data", ["--trainer.enable_progress_bar", "false"]
    short = [
        "--trainer.max_epochs",
        "1",
        "--trainer.limit_train_batches",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.val_check_interval",
        "1.0",
    ]
    build_cli(
        [
            "fit",
            "--config",
            str(root / "configs/quickstart/sft.yaml"),
            "--data.init_args.data_path",
            str(data / "quickstart_sft.jsonl"),
            *short,
            *quiet,
        ]
    )
    sft = tmp_path / "runs/quickstart-sft/export/last"
    from_sft = [
        "--model.init_args.model_name",
        str(sft),
        "--model.init_args.model_config",
        "null",
        "--model.init_args.tokenizer_name",
        "null",
    ]
    build_cli(
        [
            "fit",
            "--config",
            str(root / "configs/quickstart/reward.yaml"),
            *from_sft,
            "--data.init_args.data_path",
            str(data / "quickstart_reward.jsonl"),
            *short,
            *quiet,
        ]
    )
    reward = tmp_path / "runs/quickstart-reward/export/last"
    ppo = build_cli(
        [
            "fit",
            "--config",
            str(root / "configs/quickstart/ppo.yaml"),
            *from_sft,
            "--model.init_args.reward",
            str(reward),
            "--data.init_args.data_path",
            str(data / "quickstart_prompts.jsonl"),
            *short,
            *quiet,
        ]
    )
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(sft).state_dict()
    reference = ppo.model.reference.model.state_dict()
    assert all(torch.equal(reference[k], v) for k, v in start.items())  # PPO started from the SFT model
    (metrics,) = tmp_path.glob("runs/quickstart-ppo/csv/version_*/metrics.csv")
    rewards = [float(r["train/reward_mean"]) for r in csv.DictReader(metrics.open()) if r.get("train/reward_mean")]
    assert len(rewards) == 2 and all(math.isfinite(r) for r in rewards)
    assert (tmp_path / "runs/quickstart-ppo/export/last/model.safetensors").is_file()
