"""Regenerates ``guessing_prompts.jsonl``: 96 prompts (64 for training, 32 held out) for the multi-turn quickstart
(``configs/quickstart/multiturn.yaml``), each with the ``secret`` (1 to 7) that ``GuessingGame`` reads. Every
prompt reads the same, so the model can only find the secret from the environment's higher / lower answers.

Run: ``python -m aitraining_pl.data.make_guessing_prompts``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def main() -> None:
    path = Path(__file__).with_name("guessing_prompts.jsonl")
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(96):
            handle.write(json.dumps({"prompt": "Guess 1-7:", "secret": rng.randint(1, 7)}) + "\n")
    print(f"wrote 96 prompts to {path}")


if __name__ == "__main__":
    main()
