"""Regenerates ``quickstart_arithmetic.jsonl``: 256 sums and differences of small whole numbers for the
``real`` tests and ``benchmarks/real_vs_trl.py``.

Each row asks for the bare number (``"What is 14 + 7? Reply with just the number."``) and carries the ``answer``
(for ``aitraining_pl.rewards:exact_answer_reward``), a ``completion`` (the bare number, for SFT), and a preference
pair: ``chosen`` the bare number, ``rejected`` the worked sum that SmolLM2-135M-Instruct writes by habit
(``"14 + 7 = 21"``), or, for one row in four, a wrong bare number.
Run: ``python -m aitraining_pl.data.make_quickstart_arithmetic``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NUM_ROWS, SEED = 256, 0


def arithmetic_rows(num_rows: int = NUM_ROWS, seed: int = SEED) -> list[dict]:
    """The rows (see the module docstring), drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        op = rng.choice("+-")
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
        answer = a + b if op == "+" else a - b
        wrong = answer + rng.choice((-2, -1, 1, 2))
        rows.append(
            {
                "prompt": f"What is {a} {op} {b}? Reply with just the number.",
                "answer": answer,
                "completion": str(answer),
                "chosen": str(answer),
                "rejected": str(wrong) if rng.random() < 0.25 else f"{a} {op} {b} = {answer}",
            }
        )
    return rows


def main() -> None:
    path = Path(__file__).with_name("quickstart_arithmetic.jsonl")
    with path.open("w", encoding="utf-8") as handle:
        for row in arithmetic_rows():
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {NUM_ROWS} rows to {path}")


if __name__ == "__main__":
    main()
