"""PreferenceDataModule: batch contract, truncation, chat rows, file formats and bad-input messages."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from dpo_utils import preference_rows, write_jsonl

from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.preference import (
    LengthGroupedSampler,
    PreferenceCollator,
    PreferenceDataModule,
    PreferenceDataset,
)


def _module(byte_tokenizer, **kwargs):
    kwargs.setdefault("val_split", 0.0)
    dm = PreferenceDataModule(tokenizer=byte_tokenizer, **kwargs)
    dm.setup("fit")
    return dm


def test_batch_contract(byte_tokenizer):
    dm = _module(byte_tokenizer, prompts=["ab", "abcd"], chosen=["xyz", "x"], rejected=["q", "qrstu"], batch_size=2)
    batch = next(iter(dm.ordered_dataloaders()["train"]))
    ids = byte_tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask", "index"}
    # chosen rows first, then rejected; padded to the longest row (4 + 5 + EOS = 10), not max_length
    assert batch["input_ids"].shape == (4, 10)
    assert batch["input_ids"][0, :2].tolist() == ids
    rows = [byte_tokenizer.decode(r[m.bool()]) for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert rows == ["abxyz</s>", "abcdx</s>", "abq</s>", "abcdqrstu</s>"]
    done = [byte_tokenizer.decode(r[m.bool()]) for r, m in zip(batch["input_ids"], batch["completion_mask"])]
    assert done == ["xyz</s>", "x</s>", "q</s>", "qrstu</s>"]  # completion mask includes the EOS
    assert batch["attention_mask"].sum(1).tolist() == [6, 6, 4, 10]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == byte_tokenizer.pad_token_id).all()
    assert batch["index"].tolist() == [0, 1]


def test_margin_column(tmp_path, byte_tokenizer):
    rows = [dict(r, margin=float(i)) for i, r in enumerate(preference_rows(4))]
    dm = _module(
        byte_tokenizer, data_path=str(write_jsonl(tmp_path / "m.jsonl", rows)), margin_column="margin", batch_size=4
    )
    batch = next(iter(dm.ordered_dataloaders()["train"]))
    assert batch["margin"].dtype == torch.float32 and batch["margin"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_truncation_keeps_prompt_end_then_cuts_completions(byte_tokenizer):
    ds = PreferenceDataset(["0123456789"], ["abcdef"], ["uv"], byte_tokenizer, max_length=8, max_prompt_length=4)
    e = ds[0]
    dec = byte_tokenizer.decode
    assert dec(e["prompt_ids"]) == "6789"  # the end of the prompt is kept
    assert dec(e["chosen_ids"]) == "abcd"  # cut to max_length - prompt (the EOS is cut too)
    assert dec(e["rejected_ids"]) == "uv</s>"


def test_empty_completion_dropped_with_one_warning(caplog):
    class NoEos:  # a tokenizer without EOS, so an empty completion stays empty
        eos_token_id = None
        bos_token_id = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text.encode())}

    with caplog.at_level(logging.WARNING):
        ds = PreferenceDataset(
            ["p1", "p2", "p3"], ["", "b", ""], ["d", "e", "f"], NoEos(), max_length=4, max_prompt_length=2
        )
    assert len(ds) == 1 and ds[0]["row"] == 1
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and "dropped 2 of 3 pair(s)" in drops[0].getMessage()


def test_pairs_without_prompt_or_bos_start_from_eos(byte_tokenizer):
    # no shared prefix and a tokenizer without BOS: the pair is kept, conditioned on EOS, and every
    # completion token (including the first) is scored
    ds = PreferenceDataset(None, ["yes"], ["no"], byte_tokenizer, max_length=16, max_prompt_length=8)
    assert len(ds) == 1
    e = ds[0]
    assert e["prompt_ids"] == [byte_tokenizer.eos_token_id]
    assert byte_tokenizer.decode(e["chosen_ids"]) == "yes</s>"


def test_chat_rows_use_the_template_and_hh_rows_their_shared_prefix(byte_tokenizer, caplog):
    user = {"role": "user", "content": "hi"}
    dm = _module(
        byte_tokenizer,
        chosen=[[user, {"role": "assistant", "content": "hello there"}]],
        rejected=[[user, {"role": "assistant", "content": "go away"}]],
    )
    e = dm.train_dataset[0]
    dec = byte_tokenizer.decode
    assert dec(e["prompt_ids"]) == "<|user|>\nhi\n<|assistant|>\n"
    assert dec(e["chosen_ids"]) == "hello there\n</s>" and dec(e["rejected_ids"]) == "go away\n</s>"
    # plain-text HH style: the shared prefix becomes the prompt (its final space moves to the completions, as
    # in TRL), announced once
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dm = _module(
            byte_tokenizer, chosen=["\n\nHuman: hi\n\nAssistant: hello"], rejected=["\n\nHuman: hi\n\nAssistant: go"]
        )
    assert sum("shared prefix" in r.getMessage() for r in caplog.records) == 1
    e = dm.train_dataset[0]
    assert dec(e["prompt_ids"]) == "\n\nHuman: hi\n\nAssistant:" and dec(e["chosen_ids"]) == " hello</s>"
    # explicit prompt column with message lists
    dm = _module(byte_tokenizer, prompts=[[user]], chosen=[[{"role": "assistant", "content": "yo"}]], rejected=["no"])
    assert dec(dm.train_dataset[0]["chosen_ids"]) == "yo\n</s>"


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_file_formats_and_val_split(tmp_path, byte_tokenizer, suffix):
    rows = preference_rows(20)
    path = tmp_path / f"prefs{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pd = pytest.importorskip("pandas")
        frame = pd.DataFrame(rows)
        frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    dm = _module(byte_tokenizer, data_path=str(path), val_split=0.25)
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (15, 5)
    # a separate validation file
    dm = _module(byte_tokenizer, data_path=str(path), val_data_path=str(path))
    assert len(dm.train_dataset) == len(dm.val_dataset) == 20


def test_length_grouped_sampler_is_a_permutation_with_less_padding(byte_tokenizer):
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 200, (400,), generator=rng).tolist()
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=0)
    order = list(sampler)
    assert sorted(order) == list(range(400))
    padded = lambda idx: sum(max(lengths[i] for i in idx[j : j + 8]) * 8 for j in range(0, 400, 8))  # noqa: E731
    assert padded(order) < 0.7 * padded(list(range(400)))
    sampler.set_epoch(1)
    assert list(sampler) != order


def test_collator_pads_with_pad_token():
    batch = PreferenceCollator(pad_token_id=7)(
        [{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4], "index": 0}]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 4, 7]]
    assert batch["completion_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


BAD_CASES = [
    ("missing.jsonl", None, "file not found"),
    (
        "cols.jsonl",
        [{"prompt": "a", "chosen": "b", "answer": "c"}],
        "missing column(s) 'rejected'; columns found: prompt, chosen, answer",
    ),
    ("empty.jsonl", [{"prompt": "a", "chosen": " ", "rejected": "c"}], "row 1, field 'chosen': empty text"),
    (
        "type.jsonl",
        [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b", "rejected": 3}],
        "row 2, field 'rejected': expected a non-empty string or chat messages, got int",
    ),
    ("malformed.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": oops}\n', "row 2: malformed JSON"),
]


@pytest.mark.parametrize("name, content, message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_messages(tmp_path, byte_tokenizer, name, content, message):
    path = tmp_path / name
    if isinstance(content, list):
        write_jsonl(path, content)
    elif isinstance(content, str):
        path.write_text(content)
    with pytest.raises(DataValidationError) as info:
        _module(byte_tokenizer, data_path=str(path))
    assert str(path) in str(info.value) and message in str(info.value)


def test_identical_pairs_warn(byte_tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        _module(byte_tokenizer, prompts=["a", "b"], chosen=["same", "x"], rejected=["same", "y"])
    assert "1 pair(s) have chosen identical to rejected" in caplog.text


def test_margin_must_be_a_number(tmp_path, byte_tokenizer):
    path = write_jsonl(tmp_path / "m.jsonl", [dict(r, margin="high") for r in preference_rows(2)])
    with pytest.raises(DataValidationError, match=r"row 1, field 'margin': expected a finite number"):
        _module(byte_tokenizer, data_path=str(path), margin_column="margin")
