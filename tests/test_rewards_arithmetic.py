"""The real-model task: ``exact_answer_reward`` and the rows of ``quickstart_arithmetic.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from aitraining_pl.rewards import exact_answer_reward

DATA = Path(__file__).parents[1] / "aitraining_pl" / "data" / "quickstart_arithmetic.jsonl"


def test_exact_answer_reward_scores_the_bare_number_above_a_worked_sum():
    responses = ["21", " 21.", "14 + 7 = 21", "21 apples", "22", "no idea", "-3", "3"]
    answers = [21] * 6 + [-3, -3]
    got = exact_answer_reward([""] * 8, responses, [{"answer": a} for a in answers])
    assert got == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0]


def test_every_shipped_row_is_right_and_its_pair_is_ordered():
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 256
    for row in rows:
        a, op, b = row["prompt"].removeprefix("What is ").split("?")[0].split()
        assert row["answer"] == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert row["completion"] == row["chosen"] == str(row["answer"])
        chosen, rejected = exact_answer_reward(["", ""], [row["chosen"], row["rejected"]], [row, row])
        assert chosen == 1.0 > rejected
