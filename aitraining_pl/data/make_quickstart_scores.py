"""Regenerates ``quickstart_scores.jsonl``: 400 scored answers for the multi-objective reward quickstart.

Each row is a prompt, an answer (the chosen or rejected side of ``quickstart_reward.jsonl``'s pairs) and
three scores: ``helpful`` (1 for an explanation, 0 for a brush-off), ``polite`` (the same judgement, but
unknown, ``null``, for 40% of rows, which the loss masks) and ``concise`` (1 - length / 100). Run:
``python -m aitraining_pl.data.make_quickstart_scores``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from aitraining_pl.data.make_quickstart_reward import make as make_pairs

OBJECTIVES = ("helpful", "polite", "concise")


def make(n_pairs: int = 200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for pair in make_pairs(n_pairs, seed):
        for text, good in ((pair["chosen"], 1.0), (pair["rejected"], 0.0)):
            polite = good if rng.random() >= 0.4 else None
            concise = round(1.0 - min(1.0, len(text) / 100), 3)
            rows.append({"prompt": pair["prompt"], "text": text, "scores": [good, polite, concise]})
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    out = Path(__file__).with_name("quickstart_scores.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in make()), encoding="utf-8")
    print(f"wrote {out}")
