"""TRL's dataset formats (prompt extraction, the space rule, chat rendering), hub loading options and the
``datasets`` cache of tokenised rows, on hand-written rows in the column layouts of public datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from aitraining_pl.datamodules.formats import extract_prompt, render, split_preference
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.preference import PreferenceDataModule
from aitraining_pl.datamodules.prompt import PromptDataModule

#: A ChatML template (Qwen / OpenHermes style) for the byte tokenizer.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer():
    from aitraining_pl.models import load_tokenizer

    tok = load_tokenizer("byte")
    tok.chat_template = CHATML
    return tok


@pytest.fixture
def tok():
    return chat_tokenizer()


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Every ``datasets`` cache file of a test in its own folder."""
    import datasets

    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def write(path, rows):
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def pairs(tok, path, rows, **kwargs):
    """Decoded (prompt, chosen, rejected) of each training pair read from ``rows`` written to ``path``."""
    dm = PreferenceDataModule(data_path=write(path, rows), tokenizer=tok, val_split=0.0, **kwargs)
    dm.setup("fit")
    dec = tok.decode
    return [(dec(e["prompt_ids"]), dec(e["chosen_ids"]), dec(e["rejected_ids"])) for e in dm.train_dataset]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def chatml(*messages, generation_prompt=False):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


# -- the prompt rules on their own
@pytest.mark.parametrize(
    "chosen, rejected, expected",
    [
        ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),  # the space moves
        ("abc", "abd", ("ab", "c", "d")),  # no space: split where they differ
        ("same", "same", ("sam", "e", "e")),  # identical: each completion keeps one character
        ("ab", "abcd", ("a", "b", "bcd")),  # one a prefix of the other
        ([user("q"), assistant("a")], [user("q"), assistant("b")], ([user("q")], [assistant("a")], [assistant("b")])),
    ],
)
def test_extract_prompt(chosen, rejected, expected):
    assert extract_prompt(chosen, rejected) == expected


def test_split_preference_layouts():
    conv_c, conv_r = [user("q"), assistant("a")], [user("q"), assistant("b")]
    assert split_preference("q", conv_c, conv_r) == ([user("q")], [assistant("a")], [assistant("b")])  # UltraFeedback
    assert split_preference([user("q")], conv_c, conv_r) == ([user("q")], [assistant("a")], [assistant("b")])
    only_replies = ([user("q")], [assistant("a")], [assistant("b")])
    assert split_preference("q", [assistant("a")], [assistant("b")]) == only_replies
    assert split_preference("The sky is", " blue.", " green.") == ("The sky is", " blue.", " green.")
    # Arrow gives messages every key of the column: None values are dropped before rendering
    with_none = [{"role": "user", "content": "q", "name": None}]
    assert split_preference(with_none, [assistant("a")], [assistant("b")])[0] == [user("q")]


# -- rows in the column layouts of public datasets, read from files through ``datasets``
def test_ultrafeedback_binarized_h4_layout(tmp_path, tok):
    """HuggingFaceH4/ultrafeedback_binarized: a string prompt and full conversations repeating the user turn."""
    q = "What is 2+2?"
    row = {
        "prompt": q,
        "prompt_id": "abc123",
        "chosen": [user(q), assistant("4.")],
        "rejected": [user(q), assistant("5.")],
        "messages": [user(q), assistant("4.")],
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    }
    [(prompt, chosen, rejected)] = pairs(tok, tmp_path / "uf.parquet", [row])
    assert prompt == chatml(user(q), generation_prompt=True)  # the user turn once, with the assistant header
    assert chosen == "4.<|im_end|>\n" and rejected == "5.<|im_end|>\n"  # the template ended the turn: no EOS
    assert q not in chosen


def test_prompt_plus_completion_tokens_are_the_rendered_conversation(tmp_path, tok):
    q, a, b = "Name a colour.", "Blue, like the sky.", "No."
    rows = [
        {
            "chosen": [user(q), assistant(a)],
            "rejected": [user(q), assistant(b)],  # trl-lib/ultrafeedback_binarized
            "score_chosen": 8.0,
            "score_rejected": 1.0,
        }
    ]
    dm = PreferenceDataModule(data_path=write(tmp_path / "u.jsonl", rows), tokenizer=tok, val_split=0.0)
    dm.setup()
    e = dm.train_dataset[0]
    for key, reply in (("chosen_ids", a), ("rejected_ids", b)):
        whole = tok(render(tok, [user(q), assistant(reply)]), add_special_tokens=False)["input_ids"]
        assert e["prompt_ids"] + e[key] == whole  # no EOS after the template's end (TRL)
    assert tok.decode(e["prompt_ids"]) == chatml(user(q), generation_prompt=True)


def test_hh_rlhf_strings(tmp_path, tok):
    """Anthropic/hh-rlhf: chosen / rejected strings holding the whole (multi-turn) dialogue."""
    head = "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Tell me a fact."
    rows = [{"chosen": head + "\n\nAssistant: Water is wet.", "rejected": head + "\n\nAssistant: No."}]
    [(prompt, chosen, rejected)] = pairs(tok, tmp_path / "hh.jsonl", rows)
    assert prompt == head + "\n\nAssistant:"  # TRL: the prompt's final space goes to the completions
    assert chosen == " Water is wet.</s>" and rejected == " No.</s>"


def test_hh_rlhf_conversational_implicit_and_explicit_agree(tmp_path, tok):
    """HH-RLHF as conversations: implicit (full dialogues) and explicit (trl-lib/hh-rlhf-helpful-base style:
    prompt messages, assistant-only completions) rows give the same tokens."""
    history = [user("Hi"), assistant("Hello."), user("Tell me a fact.")]
    implicit = [{"chosen": history + [assistant("Water is wet.")], "rejected": history + [assistant("No.")]}]
    explicit = [{"prompt": history, "chosen": [assistant("Water is wet.")], "rejected": [assistant("No.")]}]
    got = pairs(tok, tmp_path / "implicit.jsonl", implicit)
    assert got == pairs(tok, tmp_path / "explicit.parquet", explicit)
    assert got == [(chatml(*history, generation_prompt=True), "Water is wet.<|im_end|>\n", "No.<|im_end|>\n")]


def test_capybara_preferences_layout(tmp_path, tok):
    """trl-lib/Capybara-Preferences: multi-turn prompt messages, assistant-only completions, extra columns."""
    prompt = [{"role": "system", "content": "Be brief."}, user("2+2?"), assistant("4"), user("And 3+3?")]
    row = {
        "prompt": prompt,
        "chosen": [assistant("6")],
        "rejected": [assistant("7")],
        "source": "GOAT",
        "chosen_rating": 5,
        "rejected_rating": 1,
        "chosen_model": "m1",
        "rejected_model": "m2",
    }
    [(p, chosen, rejected)] = pairs(tok, tmp_path / "capy.jsonl", [row])
    assert p == chatml(*prompt, generation_prompt=True)
    assert (chosen, rejected) == ("6<|im_end|>\n", "7<|im_end|>\n")


def test_explicit_standard_and_implicit_standard(tmp_path, tok):
    explicit = pairs(tok, tmp_path / "e.jsonl", [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}])
    implicit = pairs(tok, tmp_path / "i.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."}])
    assert explicit == implicit == [("The sky is", " blue.</s>", " green.</s>")]


def test_conversational_extensions(tmp_path, tok):
    """Beyond TRL: a repeated conversational prompt is removed; a string prompt beside assistant-only
    completions becomes the user turn; a prompt ending in an assistant turn is continued."""
    q = [user("Hi")]
    rows = [
        {"prompt": q, "chosen": q + [assistant("A")], "rejected": q + [assistant("B")]},
        {"prompt": "Hi", "chosen": [assistant("A")], "rejected": [assistant("B")]},
    ]
    got = pairs(tok, tmp_path / "x.jsonl", rows)
    assert got[0] == got[1] == (chatml(user("Hi"), generation_prompt=True), "A<|im_end|>\n", "B<|im_end|>\n")
    prefilled = [{"prompt": q + [assistant("Sure:")], "chosen": [assistant(" yes")], "rejected": [assistant(" no")]}]
    dm = PreferenceDataModule(
        prompts=[r["prompt"] for r in prefilled],
        chosen=[r["chosen"] for r in prefilled],
        rejected=[r["rejected"] for r in prefilled],
        tokenizer=tok,
        val_split=0.0,
    )
    dm.setup()
    e = dm.train_dataset[0]
    assert tok.decode(e["prompt_ids"]).endswith("<|im_start|>assistant\nSure:")  # no end-of-turn, no new header
    assert tok.decode(e["chosen_ids"]).startswith("<|im_end|>\n<|im_start|>assistant\n yes")


def test_prompt_module_renders_conversations_with_the_generation_prompt(tmp_path, tok):
    rows = [{"prompt": [user("Hi")], "answer": 1}, {"prompt": [user("Yo"), assistant("Well,")], "answer": 2}]
    dm = PromptDataModule(data_path=write(tmp_path / "p.jsonl", rows), tokenizer=tok, batch_size=1)
    dm.setup()
    assert dm.train_dataset.texts == [
        chatml(user("Hi"), generation_prompt=True),
        chatml(user("Yo")) + "<|im_start|>assistant\nWell,",
    ]
    assert dm.train_dataset.metadata == [{"answer": 1}, {"answer": 2}]


# -- loading options
def test_data_files_and_explicit_split_names(tmp_path, tok):
    """A ``datasets`` builder with ``data_files`` per split; ``split`` / ``val_split_name`` pick them."""
    row = {"chosen": "yes", "rejected": "no"}
    train = write(tmp_path / "train.parquet", [dict(row, prompt=f"q{i}") for i in range(6)])
    test = write(tmp_path / "test.parquet", [dict(row, prompt=f"t{i}") for i in range(2)])
    dm = PreferenceDataModule(
        data_path="parquet",
        data_files={"train_prefs": train, "test_prefs": test},
        split="train_prefs",
        val_split_name="test_prefs",
        tokenizer=tok,
    )
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (6, 2)
    assert tok.decode(dm.val_dataset[1]["prompt_ids"]) == "t1"
    # a folder of files is read as a dataset too
    dm = PromptDataModule(
        data_path=str(tmp_path),
        data_files={"train": "train.parquet", "test": "test.parquet"},
        val_split_name="test",
        tokenizer=tok,
        batch_size=2,
    )
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (6, 2)


def test_hub_options_reach_load_dataset_and_old_val_spelling_warns(monkeypatch, tok):
    import datasets

    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        chosen = f"{kwargs['split']} a" if kwargs["split"] != "broken" else " "
        return datasets.Dataset.from_list([{"prompt": "q", "chosen": chosen, "rejected": "b"}] * 2)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = PreferenceDataModule(
        data_path="org/prefs",
        name="default",
        revision="v1.0",
        split="train_prefs",
        val_split_name="test_prefs",
        tokenizer=tok,
    )
    dm.setup()
    assert calls == [
        ("org/prefs", dict(name="default", data_files=None, revision="v1.0", split=s))
        for s in ("train_prefs", "test_prefs")
    ]
    assert tok.decode(dm.val_dataset[0]["chosen_ids"]).startswith("test_prefs")
    calls.clear()
    with pytest.warns(FutureWarning, match="val_split_name: test"):
        PreferenceDataModule(data_path="org/prefs", val_data_path="org/prefs", tokenizer=tok).setup()
    assert [kwargs["split"] for _, kwargs in calls] == ["train", "test"]
    with pytest.raises(DataValidationError, match=r"^org/prefs \[broken\], row 1, field 'chosen': empty text"):
        PreferenceDataModule(data_path="org/prefs", val_split_name="broken", tokenizer=tok).setup()


def test_local_file_as_its_own_validation_source_does_not_warn(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        dm = PreferenceDataModule(data_path=path, val_data_path=path, tokenizer=tok)
        dm.setup()
    assert len(dm.train_dataset) == len(dm.val_dataset) == 3


# -- the cache of tokenised rows
@pytest.fixture
def count_calls(monkeypatch):
    """Count calls of the byte tokenizer (patched on its class, so its state and hash are unchanged)."""
    from transformers import ByT5Tokenizer

    counter = {"n": 0}
    original = ByT5Tokenizer.__call__

    def counting(self, *args, **kwargs):
        counter["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ByT5Tokenizer, "__call__", counting)
    return counter


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_second_setup_reuses_the_cached_tokenisation(tmp_path, count_calls, suffix):
    rows = [{"prompt": [user(f"q{i}")], "chosen": [assistant("yes")], "rejected": [assistant("no")]} for i in range(8)]
    path = write(tmp_path / f"p{suffix}", rows)

    def setup(**kwargs):
        count_calls["n"] = 0
        dm = PreferenceDataModule(data_path=path, tokenizer=chat_tokenizer(), val_split=0.25, **kwargs)
        dm.setup()
        return count_calls["n"], [dm.train_dataset[i] for i in range(len(dm.train_dataset))]

    calls, first = setup()
    assert calls == 3 * 8  # prompt, chosen, rejected of every row
    calls, again = setup()
    assert calls == 0 and again == first  # a fresh module with an equal tokenizer: read from the cache
    assert setup(max_length=64, max_prompt_length=32)[0] == 3 * 8  # other settings: tokenised again
    count_calls["n"] = 0
    other = chat_tokenizer()
    other.chat_template = CHATML.replace("im_start", "start")
    PreferenceDataModule(data_path=path, tokenizer=other, val_split=0.0).setup()
    assert count_calls["n"] == 3 * 8  # another chat template: tokenised again


def test_prepare_data_tokenises_once_for_every_rank(tmp_path, count_calls):
    """Lightning runs ``prepare_data`` on local rank 0, then ``setup`` on every rank after a barrier."""
    path = write(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(4)])
    PromptDataModule(data_path=path, tokenizer=chat_tokenizer(), batch_size=2).prepare_data()
    assert count_calls["n"] == 4
    for _rank in range(2):
        dm = PromptDataModule(data_path=path, tokenizer=chat_tokenizer(), batch_size=2)
        dm.setup("fit")
        assert len(dm.train_dataset) == 4 and dm.train_dataset[3]["metadata"] == {"answer": 3}
    assert count_calls["n"] == 4


def test_fit_tokenises_once(tmp_path, count_calls):
    """Under ``Trainer.fit``: ``prepare_data`` tokenises, ``setup`` (every rank, after the barrier) reads the cache."""
    import lightning.pytorch as pl
    from conftest import TINY_LLAMA

    from aitraining_pl import DPOModule

    path = write(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(4)])
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    dm = PreferenceDataModule(data_path=path, tokenizer=module.tokenizer, val_split=0.0, batch_size=2)
    count_calls["n"] = 0
    calls = []
    original_setup = dm.setup

    def setup(stage=None):
        calls.append(count_calls["n"])
        original_setup(stage)
        calls.append(count_calls["n"])

    dm.setup = setup
    trainer = pl.Trainer(
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    assert calls == [12, 12]  # 4 rows x (prompt, chosen, rejected), all before setup
    assert len(dm.train_dataset) == 4


@pytest.mark.slow
def test_another_process_reuses_the_cache(tmp_path, datasets_cache, count_calls):
    """The fingerprint is stable across processes (a second run, or another rank, loads the cached rows)."""
    path = write(tmp_path / "p.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."}] * 4)
    PreferenceDataModule(data_path=path, tokenizer="byte", val_split=0.0).setup()
    assert count_calls["n"] == 12
    script = textwrap.dedent(f"""
        import datasets, transformers
        datasets.config.HF_DATASETS_CACHE = {str(datasets_cache)!r}
        calls = []
        original = transformers.ByT5Tokenizer.__call__
        transformers.ByT5Tokenizer.__call__ = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
        from aitraining_pl.datamodules.preference import PreferenceDataModule
        dm = PreferenceDataModule(data_path={path!r}, tokenizer="byte", val_split=0.0)
        dm.setup()
        print("CALLS", len(calls), len(dm.train_dataset))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "CALLS 0 4" in run.stdout, run.stderr[-2000:]


@pytest.mark.ddp
def test_ddp_tokenises_on_rank_zero_only(tmp_path):
    """2-process CPU DDP: rank 0 tokenises in ``prepare_data``; neither rank tokenises in ``setup``."""
    write(tmp_path / "pairs.jsonl", [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(8)])
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(tests, "helpers", "data_ddp_script.py")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.path.dirname(tests),
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
    }
    proc = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert counts == [{"before_setup": 24, "in_setup": 0}, {"before_setup": 0, "in_setup": 0}]


# -- bad input on the new paths
@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [
                {"prompt": "q", "chosen": [assistant("a")], "rejected": [assistant("b")]},
                {"prompt": "q", "chosen": [assistant("a")]},
            ],
            "row 2, field 'rejected': missing field",
        ),
        (
            [
                {"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("b")]},
                {"chosen": [user("q"), {"role": "assistant"}], "rejected": [user("q"), assistant("b")]},
            ],
            "row 2, field 'chosen': message 1 is not a {role, content} dict",
        ),
        (
            [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": " ", "chosen": "a", "rejected": "b"}],
            "row 2, field 'prompt': empty text",
        ),
        (
            [
                {"prompt": [user("q")], "chosen": [assistant("a")], "rejected": [assistant("b")], "margin": 1.0},
                {"prompt": [user("q")], "chosen": [assistant("a")], "rejected": [assistant("b")], "margin": None},
            ],
            "row 2, field 'margin': expected a finite number, got None",
        ),
    ],
)
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_bad_rows_name_file_row_and_field(tmp_path, tok, rows, message, suffix):
    path = tmp_path / f"bad{suffix}"
    with pytest.raises(DataValidationError) as info:
        pairs(tok, path, rows, margin_column="margin" if "margin" in rows[0] else None)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_bad_sources_are_named(tmp_path, tok, monkeypatch):
    import datasets

    def missing(path, **kwargs):
        raise FileNotFoundError(f"Dataset {path!r} doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(DataValidationError, match=r"^org/nothing: not a local file and not loadable"):
        PreferenceDataModule(data_path="org/nothing", tokenizer=tok).setup()
    with pytest.raises(DataValidationError, match="val_split_name needs a data_path"):
        PreferenceDataModule(chosen=["a"], rejected=["b"], val_split_name="test", tokenizer=tok).setup()
    path = write(tmp_path / "p.jsonl", [{"prompt": "q", "answer": 1}, {"prompt": "r"}])
    with pytest.raises(DataValidationError, match=r"p.jsonl, row 2, field 'answer': missing field"):
        PromptDataModule(data_path=path, metadata_columns=["answer"], tokenizer=tok, batch_size=1).setup()


def test_a_local_file_holds_out_val_split_where_a_hub_split_is_named(tmp_path, tok):
    """A hub recipe's ``val_split_name: test`` on a local file (one file has one split): ``val_split`` of its rows is
    held out, not the whole file validated on the rows it trains on."""
    rows = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(10)]
    dm = PreferenceDataModule(
        data_path=write(tmp_path / "p.jsonl", rows), val_split_name="test", val_split=0.2, tokenizer=tok
    )
    dm.setup()
    train = {tok.decode(r["prompt_ids"]) for r in dm.train_dataset}
    held_out = {tok.decode(r["prompt_ids"]) for r in dm.val_dataset}
    assert (len(train), len(held_out)) == (8, 2) and not train & held_out
