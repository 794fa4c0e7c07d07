"""The real-model quickstart's task: ``short_answer_reward`` and the rows of ``quickstart_capitals.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from aitraining_pl.data.make_quickstart_capitals import capital_rows
from aitraining_pl.rewards import short_answer_reward

DATA = Path(__file__).parents[1] / "aitraining_pl" / "data" / "quickstart_capitals.jsonl"


def test_short_answer_reward_is_the_share_of_the_words_that_are_the_answer():
    responses = {
        "Paris": 1.0,  # just the answer
        " paris. ": 1.0,  # case, spaces and edge punctuation aside
        "**Paris**": 1.0,
        "Paris, France.": 1 / 2,
        "The capital of France is Paris.": 1 / 6,
        "Paris = Paris": 1 / 2,  # "=" is not a word: two words, the answer once counted
        "Lyon": 0.0,
        "Parisian": 0.0,  # a whole word only
        "": 0.0,
    }
    got = short_answer_reward([""] * len(responses), list(responses), [{"answer": "Paris"}] * len(responses))
    assert got == list(responses.values())


def test_a_multi_word_or_numeric_answer_counts_its_words():
    responses = ["New Delhi", "It is New Delhi.", "Delhi New", "14 + 7 = 21", "-3", "3"]
    answers = ["New Delhi", "New Delhi", "New Delhi", 21, -3, -3]
    got = short_answer_reward([""] * 6, responses, [{"answer": a} for a in answers])
    assert got == [1.0, 2 / 4, 0.0, 1 / 3, 1.0, 0.0]  # "14", "7", "21": "+" and "=" are not words


def test_the_shipped_file_is_what_its_generator_writes_and_each_answer_is_one_word():
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    assert rows == capital_rows()
    assert len({r["prompt"] for r in rows}) == len(rows) >= 90
    for row in rows:
        assert row["prompt"].endswith("? Answer with one word.")
        assert short_answer_reward([row["prompt"]], [row["answer"]], [row]) == [1.0]
        assert row["answer"].isascii() and row["answer"].isalpha()
