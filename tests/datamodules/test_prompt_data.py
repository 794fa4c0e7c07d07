"""PromptDataModule: reading, up-front validation, metadata, left padding, chat templates."""

from __future__ import annotations

import json

import pytest

from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.prompt import PromptDataModule


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_left_padded_batches_with_metadata(tmp_path, byte_tokenizer):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": "4"},
            {"prompt": "Hi", "answer": "x"},
        ],
    )
    dm = PromptDataModule(data_path=path, tokenizer=byte_tokenizer, batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader() or [dm.collate_fn([dm.train_dataset[0], dm.train_dataset[1]])]))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (2, len("What is 2+2?"))
    assert mask[1].tolist() == [0] * 10 + [1, 1]  # left padding
    assert byte_tokenizer.decode(ids[1, -2:]) == "Hi" and ids[1, 0].item() == byte_tokenizer.pad_token_id
    assert batch["prompts"] == ["What is 2+2?", "Hi"]
    assert batch["metadata"] == [{"answer": "4"}, {"answer": "x"}]
    loader = dm.train_dataloader()
    assert loader.drop_last and len(loader) == 1


def test_in_memory_prompts_truncate_from_the_left(byte_tokenizer):
    dm = PromptDataModule(
        prompts=["abcdefgh", "xy"],
        metadata=[{"k": 1}, {"k": 2}],
        tokenizer=byte_tokenizer,
        batch_size=1,
        max_prompt_length=4,
    )
    dm.setup()
    assert byte_tokenizer.decode(dm.train_dataset[0]["input_ids"]) == "efgh"
    assert dm.train_dataset[1]["metadata"] == {"k": 2}
    assert dm.sample_prompts(1) == (["abcdefgh"], [{"k": 1}])


def test_metadata_columns_select_and_validation_split(tmp_path, byte_tokenizer):
    rows = [{"prompt": f"q{i}", "answer": str(i), "junk": i} for i in range(10)]
    dm = PromptDataModule(
        data_path=_write_jsonl(tmp_path / "p.jsonl", rows),
        metadata_columns=["answer"],
        tokenizer=byte_tokenizer,
        batch_size=2,
        val_split=0.2,
    )
    dm.setup()
    assert len(dm.train_dataset) == 8 and len(dm.val_dataset) == 2
    assert set(dm.train_dataset.metadata[0]) == {"answer"}


def test_chat_messages_use_the_template(byte_tokenizer):
    dm = PromptDataModule(
        prompts=[[{"role": "user", "content": "hello"}], "plain"],
        tokenizer=byte_tokenizer,
        batch_size=1,
        use_chat_template=False,
    )
    dm.setup()
    assert "hello" in dm.train_dataset.texts[0] and dm.train_dataset.texts[0] != "hello"
    assert dm.train_dataset.texts[1] == "plain"


@pytest.mark.parametrize(
    "rows, message",
    [
        (['{"prompt": "ok"}', '{"prompt": "ok", '], r"p.jsonl, row 2: malformed JSON"),
        ([{"text": "no prompt column"}], r"missing column\(s\) 'prompt'; columns found: text"),
        ([{"prompt": "ok"}, {"prompt": "   "}], r"row 2, field 'prompt': empty text"),
        ([{"prompt": "ok"}, {"prompt": 3}], r"row 2, field 'prompt': expected a non-empty string"),
        ([{"prompt": "ok"}], r"fewer than batch_size=2"),
    ],
)
def test_bad_data_is_rejected_before_training(tmp_path, byte_tokenizer, rows, message):
    dm = PromptDataModule(data_path=_write_jsonl(tmp_path / "p.jsonl", rows), tokenizer=byte_tokenizer, batch_size=2)
    with pytest.raises(DataValidationError, match=message):
        dm.setup("fit")


def test_missing_file_and_missing_metadata_field(tmp_path, byte_tokenizer):
    with pytest.raises(DataValidationError, match="file not found"):
        PromptDataModule(data_path=str(tmp_path / "nope.jsonl"), tokenizer=byte_tokenizer).setup()
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b"}])
    dm = PromptDataModule(data_path=path, metadata_columns=["answer"], tokenizer=byte_tokenizer, batch_size=1)
    with pytest.raises(DataValidationError, match="row 2, field 'answer': missing field"):
        dm.setup()
